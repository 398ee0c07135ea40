"""The local node: zygotes, templates and instances as real processes on this machine.

    LocalNode (the gateway's event loop)
      └─ zygote, one per runtime        python -m ember.node.zygote (its own session)
           ├─ template, one per model   forked; loads the model, forks replicas
           │    └─ instance ...         rung TEMPLATE: shares the weights copy-on-write
           └─ instance ...              rung ZYGOTE: loads the weights itself

Every process listens on a Unix socket under `state_dir/run` and greets the node's
connection with a hello once ready (`ember.node.process_table`: the processes, their
connections and their exits). This module decides what runs: which process starts a
model's instance, from which rung, and what a model keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ember
from ember.clock import SystemClock
from ember.core.bandwidth import Bandwidths
from ember.core.clock import Clock
from ember.core.slices import Slice
from ember.core.states import Rung
from ember.environments.registry import Environments
from ember.errors import EmberError, InvalidInput, ModelNotReady, WorkerCrashed
from ember.node import keeping
from ember.node.api import ExitCallback, MemoryUsage, StartedInstance, StoreUsage, collect
from ember.node.forkserver import listen_unix
from ember.node.framing import Header
from ember.node.holds import ZygoteHolds
from ember.node.instance import sleep_levels, slice_to_json
from ember.node.polling import PollPolicy
from ember.node.process_table import KILLED as _KILLED
from ember.node.process_table import ProcessTable
from ember.node.processes import NodeProcess, control, memory_of_process, signal_process
from ember.node.replies import InstanceReplies
from ember.node.restores import NodeImages, become, exit_status
from ember.node.sandbox import model_uid
from ember.node.sandboxes import Sandboxes
from ember.node.weights import NodeWeights, prime_mapped
from ember.store.config import StoreConfig, default_root
from ember.store.store import WeightStore
from ember.store.tiers.peer import FetchGate, PeerDirectory
from ember.wire.contract import RUNTIME_ENVIRONMENTS, ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.node")

# The server's own secrets, given in its environment (ember.config): they open the peer routes, the shared job
# store and the key store; a model's processes and the images of them never need them.
NODE_SECRETS = ("EMBER_CLUSTER_TOKEN", "EMBER_JOBS_URL", "EMBER_API_KEY", "PGPASSWORD")
MAX_SOCKET_DIR = 90           # sun_path holds 108 bytes; names below add at most ~16


class LocalNode:
    """Implements `ember.node.api.Node` with real processes; use it from one asyncio event loop.

    `state_dir`: sockets go under `state_dir/run` (kept short: Unix socket paths are limited).
    `store`: the weight store for contracts whose weights are `store:NAME[:VERSION]` (None: no store;
    such contracts then fail to prepare, naming the missing setting).
    `env`: extra environment for the zygotes (and so for everything forked from them).
    `ready_timeout_s`: how long a zygote, template or instance may take to become ready.
    `stop_timeout_s`: how long `stop` lets an instance drain before SIGKILL.
    `poll_s`: how long an instance polls for its next request after a reply, and this side for a reply
    around its expected time, before sleeping, while a core is spare (`ember.node.polling`; 0: never).
    `python`: the interpreter of zygotes in ember's own environment; a runtime with an environment of its own
    (`RUNTIME_ENVIRONMENTS`: vllm) runs in that environment's, from `environments` (ModelNotReady if not built).
    `sandbox`: instances close a sandbox around themselves (`ember.node.sandbox`: their model's own user, a
    memory cgroup at the contract's `memory_mb`, read-only files, no network unless the contract asks, seccomp);
    what the machine does not permit is skipped and logged once per model.
    `max_reply_bytes`: the most tensor bytes one reply of an instance may carry (the gateway's body budget; None: an
    instance's memory alone bounds it, `ember.node.instance.payload_limits`). A process whose frame is past its
    limits is killed and logged.
    """

    def __init__(self, state_dir: str | Path, *, store: StoreConfig | None = None,
                 env: Mapping[str, str] | None = None, clock: Clock | None = None,
                 ready_timeout_s: float = 120.0, stop_timeout_s: float = 10.0,
                 poll_s: float = 0.0, python: str = sys.executable, sandbox: bool = True,
                 store_peers: PeerDirectory | None = None, store_gate: FetchGate | None = None,
                 environments: Environments | None = None, max_reply_bytes: int | None = None,
                 snapshots: bool = False) -> None:
        self.run_dir = Path(state_dir).resolve() / "run"
        if len(str(self.run_dir).encode()) > MAX_SOCKET_DIR:
            raise InvalidInput(f"state_dir: {str(self.run_dir)!r} is too long for Unix sockets "
                               f"(keep state_dir/run under {MAX_SOCKET_DIR} bytes)")
        self._extra_env = dict(env or {})
        self._weights = NodeWeights(store, peers=store_peers, gate=store_gate)
        self._clock = clock or SystemClock()
        self._ready_timeout_s, self._stop_timeout_s = ready_timeout_s, stop_timeout_s
        self._max_reply_bytes = max_reply_bytes
        self._python = python
        self._environments = environments or Environments()
        self._sandbox = sandbox
        self._sandboxes = Sandboxes(hidden=(str(self.run_dir.parent),))
        self._table = ProcessTable(self.run_dir, self._sandboxes, PollPolicy(poll_s), max_reply_bytes,
                                   ready_timeout_s)   # the processes, their connections and exits
        self._images = NodeImages(self.run_dir.parent / "images", snapshots, self._env, store=self._weights.store)
        self._holds = ZygoteHolds(self._contract_json)   # what each runtime's zygote holds for deployed models
        self._locks: dict[str, asyncio.Lock] = {}
        self._serial = itertools.count(1)
        self._loads = 0   # processes that ran a model's load() here: templates and instances not from a template

    # --- Node protocol ---------------------------------------------------------------------

    async def prepare(self, contract: ModelContract) -> None:
        """The zygote, and the template if kept. A template loads from local tiers: its weights are fetched
        here (deploy time); a store-backed model without one is left remote, for its first start to FETCH."""
        self._weights.check(contract)
        self._sandboxes.deployed(contract)
        await asyncio.to_thread(prime_mapped, contract)
        zygote = await self._zygote(contract.runtime)
        if zygote.link is not None:
            await self._holds.hold(zygote.link.call, zygote.hello, contract)
        imaged = await self._images.found(contract)   # an image made earlier (a restart): no load
        if self._images.enabled:   # off the request path: its own process loads the model and is dumped
            self._table.spawn_task(self._images.ensure(contract))
        if not contract.scaling.keep_template:
            return
        async with self._lock(f"template:{contract.key}"):
            if self.has_template(contract.key):
                return
            if imaged and self._images.forkable(contract) and await self._restore_template(contract):
                return
            async with self._weights.starting(contract):
                await self._fetch(contract)
                await self._fork_template(zygote, contract)

    async def release(self, model_key: str) -> None:
        self._images.drop(model_key)
        self._sandboxes.released(model_key)
        held = self._holds.release(model_key)
        zygote = self._table.procs.get(f"zygote:{held.runtime}") if held is not None else None
        if held is not None and zygote is not None and zygote.ready and zygote.link is not None:
            await self._holds.drop(zygote.link.call, held)
        instances = [p.tag for p in self._table.procs.values() if p.kind == "instance" and p.model_key == model_key]
        await asyncio.gather(*(self.stop(iid) for iid in instances))
        template = self._table.procs.get(f"template:{model_key}")
        if template is not None:
            template.retiring = True
            await self._table.kill_and_wait(template)

    def can_restore(self, contract: ModelContract) -> bool:
        return self._images.ready(contract)

    def snapshot_status(self) -> dict[str, Any]:
        """The images (`NodeImages.status`), and how many processes loaded a model here since the node started
        (templates, instances from a zygote, snapshot hosts): what the images spare."""
        status = self._images.status()
        return {**status, "loads": self._loads + self._images.made}

    def has_template(self, model_key: str) -> bool:
        template = self._table.procs.get(f"template:{model_key}")
        return template is not None and template.ready

    def has_zygote(self, runtime: str) -> bool:
        zygote = self._table.procs.get(f"zygote:{runtime}")
        return zygote is not None and zygote.ready

    async def start_zygote(self, runtime: str) -> None:
        await self._zygote(runtime)

    async def release_template(self, model_key: str) -> bool:
        """Stop the model's template unless an instance forked from it lives (it would die with it)."""
        return await self._release(f"template:{model_key}")

    async def release_zygote(self, runtime: str) -> bool:
        """Stop the runtime's zygote unless it has a child (a template, an instance, one starting)."""
        return await self._release(f"zygote:{runtime}")

    async def _release(self, key: str) -> bool:
        proc = self._table.procs.get(key)
        if proc is None:
            return True
        if self._children(proc):
            return False
        # Not ready from now on: a start or a prepare that comes meanwhile does not fork from it.
        proc.ready, proc.retiring = False, True
        async with self._lock(key):
            await self._table.kill_and_wait(proc)
        return True

    def _children(self, parent: NodeProcess) -> list[NodeProcess]:
        return [p for p in self._table.procs.values() if p.parent is parent and not p.exited.done()]

    def weights_local(self, contract: ModelContract) -> bool:
        return self._weights.local(contract)

    def store_backed(self, contract: ModelContract) -> bool:
        return self._weights.memory_tier(contract)

    async def release_weights(self, contract: ModelContract, keep: Sequence[ModelContract]) -> int:
        """The model's chunks out of the memory tier (not those of `keep`); an instance that still maps one keeps
        its pages, and a start meanwhile reads what went from disk (the fill behind it copies them up again)."""
        return await self._weights.release_memory(contract, keep)

    async def fill_weights(self, contract: ModelContract) -> None:
        await self._weights.fill_memory(contract)

    def bandwidths(self) -> Bandwidths:
        return self._weights.bandwidths()

    def weights_size(self, contract: ModelContract) -> tuple[int, int] | None:
        return self._weights.size(contract)

    async def start(self, contract: ModelContract, rung: Rung, slice_: Slice) -> StartedInstance:
        if rung is Rung.TEMPLATE:   # the replica shares its template's pages: nothing to load, nothing to fill
            return await self._start(contract, rung, slice_)
        if rung is Rung.RESTORE:    # its image holds the loaded model: nothing to load either
            return await self._start_restored(contract, slice_)
        async with self._weights.starting(contract):   # memory-tier fills wait for the start, then follow it
            return await self._start(contract, rung, slice_)

    async def _start(self, contract: ModelContract, rung: Rung, slice_: Slice) -> StartedInstance:
        started, fetched_s = self._clock.now(), 0.0
        if rung is Rung.TEMPLATE:
            parent = self._table.procs.get(f"template:{contract.key}")
            if parent is None or not parent.ready:
                raise ModelNotReady(f"model '{contract.key}': no template on this node (prepare it first)")
        elif rung is Rung.ZYGOTE:
            parent = await self._zygote(contract.runtime)
        elif rung is Rung.FETCH:
            self._weights.check(contract)
            await self._fetch(contract)
            fetched_s = self._clock.now() - started
            parent = await self._zygote(contract.runtime)
        else:
            raise InvalidInput(f"rung: an instance starts from 'template', 'zygote' or 'fetch', not {rung.value!r}")
        serial = next(self._serial)
        sock_name = f"i{serial}.s" if parent.replica_dir is None else f"{parent.replica_dir.name}/i{serial}.s"
        proc = self._table.new(f"{contract.name}-{serial}", "instance", sock_name, parent,
                              model_key=contract.key, runtime=contract.runtime, rung=rung, contract=contract)
        what = f"model '{contract.key}': instance {proc.tag} from the {rung.value}"
        command: Header = {"kind": "instance", "contract": self._contract_json(contract),
                           "slice": slice_to_json(slice_), "store": self._weights.child_json()}
        if self._sandbox and contract.sandbox.enabled:
            command["sandbox"] = self._sandboxes.plan(proc, contract).to_json()
        await self._table.fork_and_greet(proc, what, command)
        self._loads += rung is not Rung.TEMPLATE
        self._sandboxes.log_once(contract.key, proc.hello.get("sandbox"))
        total = self._clock.now() - started
        phases = {"load": float(proc.hello.get("load_s", 0.0)), "warmup": float(proc.hello.get("warmup_s", 0.0))}
        if rung is Rung.FETCH:
            phases["fetch"] = fetched_s
        phases["spawn"] = max(0.0, total - sum(phases.values()))
        return StartedInstance(proc.tag, proc.pid, rung, total, phases, sleep_levels(proc.hello))

    async def _start_restored(self, contract: ModelContract, slice_: Slice) -> StartedInstance:
        started, serial = self._clock.now(), next(self._serial)
        proc = self._table.new(f"{contract.name}-{serial}", "instance", f"i{serial}.s", None, model_key=contract.key,
                              runtime=contract.runtime, rung=Rung.RESTORE, contract=contract)
        command: Header = {"op": "become", "sock": str(proc.sock), "contract": self._contract_json(contract),
                           "slice": slice_to_json(slice_)}
        if self._sandbox and contract.sandbox.enabled:
            command["sandbox"] = self._sandboxes.plan(proc, contract).to_json()
        await self._restore_as(proc, contract, command, f"model '{contract.key}': instance {proc.tag} from its image")
        self._sandboxes.log_once(contract.key, proc.hello.get("sandbox"))
        total = self._clock.now() - started
        return StartedInstance(proc.tag, proc.pid, Rung.RESTORE, total, {"restore": total}, sleep_levels(proc.hello))

    async def _restore_template(self, contract: ModelContract) -> bool:
        """The model's template restored from its image instead of loaded (False: it could not be; logged)."""
        proc = self._new_template(contract, None)
        command: Header = {"op": "become_template", "sock": str(proc.sock), "contract": self._contract_json(contract),
                           **self._template_sandbox(proc, contract)}
        started = self._clock.now()
        try:
            await self._restore_as(proc, contract, command, f"model '{contract.key}': template from its image")
        except ModelNotReady as err:
            log.warning("%s; the template loads instead", err.message)
            return False
        log.info("model '%s': template restored from its image in %.2f s", contract.key, self._clock.now() - started)
        self._sandboxes.log_once(contract.key, proc.hello.get("sandbox"))
        return True

    async def _restore_as(self, proc: NodeProcess, contract: ModelContract, command: Header, what: str) -> None:
        """A copy of the model's image, restored in `proc`'s cgroups, told what to become (`command`), greeted."""
        procs = [] if proc.cgroup is None else [d / "cgroup.procs" for d in {proc.cgroup.memory, proc.cgroup.pids}
                                                 if d is not None]
        proc.own_pidns = True
        try:
            restored = await self._images.restore(contract, procs)
            proc.pid, proc.restorer = restored.pid, restored.criu.pid
            self._table.spawn_task(self._watch_restored(proc, restored))
            await asyncio.to_thread(become, restored, command)
            await self._table.attach_and_greet(proc, what)
        except asyncio.CancelledError:
            await self._table.kill_and_wait(proc)
            raise
        except Exception as err:
            await self._table.kill_and_wait(proc)
            why = err.message if isinstance(err, EmberError) else f"{type(err).__name__}: {err}"
            self._images.forget(contract, why)
            raise ModelNotReady(f"{what}: {why}") from None

    async def _watch_restored(self, proc: NodeProcess, restored: Any) -> None:
        """A restored process is `criu restore`'s child, not a fork server's: its exit is CRIU's."""
        self._table.gone(proc, await exit_status(restored.criu))

    async def open(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                   tenant: str | None = None) -> InstanceReplies:
        proc = self._table.instance(instance_id)
        if proc.retiring or proc.link is None:
            raise WorkerCrashed(f"instance {instance_id} is retiring")
        header: Header = {"op": "infer"}
        if proc.link.limits is not None:   # the instance answers a reply past it with an error, not the reply
            header["reply_bytes"] = proc.link.limits.of({"op": "result"})
        if timeout_s is not None:
            # Absolute on CLOCK_MONOTONIC (shared by every process here): time unread in the socket counts.
            header["deadline"] = time.monotonic() + max(1e-3, timeout_s)
        if tenant is not None:
            header["tenant"] = tenant
        return InstanceReplies(instance_id, await proc.link.request(header, inputs))

    async def infer(self, instance_id: str, inputs: Tensors, *, timeout_s: float | None = None,
                    tenant: str | None = None) -> Tensors:
        return await collect(await self.open(instance_id, inputs, timeout_s=timeout_s, tenant=tenant),
                             self._max_reply_bytes)

    async def pause(self, instance_id: str) -> None:
        signal_process(self._table.instance(instance_id), signal.SIGSTOP)

    async def resume(self, instance_id: str) -> None:
        signal_process(self._table.instance(instance_id), signal.SIGCONT)

    async def sleep(self, instance_id: str, level: int) -> float:
        proc = self._table.instance(instance_id)
        signal_process(proc, signal.SIGCONT)   # a paused instance cannot answer
        reply = await control(proc, {"op": "sleep", "level": level}, self._ready_timeout_s)
        signal_process(proc, signal.SIGSTOP)
        return float(reply.header.get("held_mb", 0.0))

    async def wake(self, instance_id: str) -> None:
        proc = self._table.instance(instance_id)
        signal_process(proc, signal.SIGCONT)
        await control(proc, {"op": "wake"}, self._ready_timeout_s)

    async def stop(self, instance_id: str) -> None:
        proc = self._table.procs.get(instance_id)
        if proc is None or proc.kind != "instance":
            return
        proc.retiring = True
        if not proc.ready:
            # Still starting: nothing to drain. Its start() sees `retiring` and fails; a pid of 0
            # (fork not answered yet) must never reach os.kill, which would signal our whole group.
            await self._table.kill_and_wait(proc)
            return
        with contextlib.suppress(WorkerCrashed):
            signal_process(proc, signal.SIGCONT)  # a paused instance cannot drain
        try:
            await asyncio.wait_for(self._drain(proc), self._stop_timeout_s)
        except (TimeoutError, EmberError) as err:
            log.warning("instance %s did not drain (%s); killing it", instance_id, err)
        if not proc.exited.done():
            await self._table.kill_and_wait(proc)

    def memory(self, instance_id: str) -> MemoryUsage:
        return memory_of_process(self._table.instance(instance_id))

    def zygote_memory(self) -> dict[str, MemoryUsage]:
        out = {}
        for proc in list(self._table.procs.values()):
            if proc.kind == "zygote" and proc.ready:
                with contextlib.suppress(WorkerCrashed):
                    out[proc.tag.removeprefix("zygote:")] = memory_of_process(proc)
        return out

    def store_usage(self) -> StoreUsage:
        w = self._weights
        return StoreUsage(w.usage(), w.fetched(), w.fetch_s)

    def template_memory(self, model_key: str) -> MemoryUsage | None:
        template = self._table.procs.get(f"template:{model_key}")
        if template is None or not template.ready:
            return None
        try:
            return memory_of_process(template)
        except WorkerCrashed:
            return None

    def on_exit(self, callback: ExitCallback) -> None:
        self._table.callbacks.append(callback)

    async def close(self) -> None:
        """Kill every process this node started and wait until the zygotes are reaped."""
        self._table.closing = True
        self._images.close()   # a snapshot host loading for an image
        procs = list(self._table.procs.values())
        for proc in procs:
            proc.retiring = True
            if proc.kind != "zygote" and proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            if proc.kind == "zygote" and proc.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its session: templates, instances, strays
                self._table.gone(proc, await proc.process.wait())
        for proc in procs:
            self._table.gone(proc, _KILLED)
        tasks = [p.link.task for p in procs if p.link is not None]
        await asyncio.gather(*tasks, *self._table.tasks, return_exceptions=True)
        await self._sandboxes.close()
        await asyncio.to_thread(self._weights.close)

    # --- extras (tests, benchmarks, status) -------------------------------------------------

    async def ping(self, instance_id: str) -> None:
        """A round trip to the instance (answered only when it is running)."""
        proc = self._table.instance(instance_id)
        assert proc.link is not None
        await proc.link.call({"op": "ping"})

    def pids(self) -> dict[str, int]:
        """Every live process this node started: tag ("zygote:RUNTIME", "template:KEY", instance id) -> pid."""
        return {p.tag: p.pid for p in self._table.procs.values() if p.pid}

    def exit_status(self, instance_id: str) -> int | None:
        """How a gone instance left (exit code or -signal); None while it runs or if unknown."""
        return self._table.exit_statuses.get(instance_id)

    def startup(self, instance_id: str) -> Header:
        """The instance's hello: its threads and the seconds it spent loading and warming up."""
        return dict(self._table.instance(instance_id).hello)

    # --- processes ---------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _fetch(self, contract: ModelContract) -> None:
        """Pull a store-backed model's weights unless they are local (once: concurrent starts wait for it)."""
        async with self._lock(f"fetch:{contract.key}"):
            if not self._weights.local(contract):
                await self._weights.fetch(contract)

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self._extra_env}
        package_root = str(Path(ember.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # `python -m` would put the server's working directory first on the path: its modules shadowing the
        # runtime's, its files in every model's view (`ember.node.sandbox`).
        env["PYTHONSAFEPATH"] = "1"
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = "1"  # no pool in a process that forks; instances raise it for their slice
        for name in NODE_SECRETS:   # the node's own credentials: no model's code reads them, no image holds them
            env.pop(name, None)
        return env

    async def _zygote(self, runtime: str) -> NodeProcess:
        async with self._lock(f"zygote:{runtime}"):
            zygote = self._table.procs.get(f"zygote:{runtime}")
            if zygote is not None and zygote.ready:
                return zygote
            return await self._spawn_zygote(runtime)

    async def _spawn_zygote(self, runtime: str) -> NodeProcess:
        proc = self._table.new(f"zygote:{runtime}", "zygote", f"z{next(self._serial)}.s", None)
        what = f"runtime {runtime!r}: zygote"
        try:
            python = self._environments.python(RUNTIME_ENVIRONMENTS.get(runtime), self._python)
            listener = listen_unix(proc.sock)
            try:
                proc.process = await asyncio.create_subprocess_exec(
                    python, "-m", "ember.node.zygote", "--runtime", runtime,
                    "--listen-fd", str(listener.fileno()), "--parent-pid", str(os.getpid()),
                    pass_fds=(listener.fileno(),), env=self._env(), stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True)
            finally:
                listener.close()
            proc.pid = proc.process.pid
            self._table.spawn_task(self._watch_zygote(proc))
            await self._table.greet(proc, what)
            if proc.link is not None:   # in the background; the zygote runs them in order with the forks it is sent
                self._table.spawn_task(self._holds.held_again(proc.link.call, proc.hello, runtime))
        except BaseException:
            await self._table.kill_and_wait(proc)
            raise
        return proc

    async def _watch_zygote(self, proc: NodeProcess) -> None:
        assert proc.process is not None
        self._table.gone(proc, await proc.process.wait())

    async def _fork_template(self, zygote: NodeProcess, contract: ModelContract) -> None:
        proc = self._new_template(contract, zygote)
        what = f"model '{contract.key}': template"
        command: Header = {"kind": "template", "contract": self._contract_json(contract),
                           "store": self._weights.child_json(), **self._template_sandbox(proc, contract)}
        await self._table.fork_and_greet(proc, what, command)
        self._loads += 1
        self._sandboxes.log_once(contract.key, proc.hello.get("sandbox"))
        if proc.hello.get("threads", 1) != 1:
            log.warning("%s has %s threads after loading: forking it is unsafe", what, proc.hello["threads"])

    def _new_template(self, contract: ModelContract, parent: NodeProcess | None) -> NodeProcess:
        return self._table.new(f"template:{contract.key}", "template", f"t{next(self._serial)}.s", parent,
                               model_key=contract.key)

    def _template_sandbox(self, proc: NodeProcess, contract: ModelContract) -> Header:
        """A sandboxed template's plan (`{"sandbox": ...}`; {} without one): the view, writable only where it binds
        its replicas' sockets."""
        if not (self._sandbox and contract.sandbox.enabled):
            return {}
        proc.replica_dir = self._replica_dir(proc, model_uid(contract.key))
        return {"sandbox": self._sandboxes.plan(proc, contract, writable=(str(proc.replica_dir),)).to_json()}

    def _replica_dir(self, template: NodeProcess, uid: int) -> Path:
        """The one directory a sandboxed template may write: its replicas' sockets (its model's user's, 0700)."""
        path = self.run_dir / f"r{template.sock.stem}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        with contextlib.suppress(PermissionError):   # not root: the template keeps this node's user anyway
            os.chown(path, uid, uid)
        return path

    async def _drain(self, proc: NodeProcess) -> None:
        if proc.link is not None:
            drained = await proc.link.call({"op": "drain"})
            handed = drained.header.get("keep")
            if isinstance(handed, dict) and proc.contract is not None:   # what it learned (ember.node.keeping)
                await asyncio.to_thread(keeping.keep_logged, proc.contract, handed, drained.tensors,
                                        roots=self._store_roots(), store=self._model_store(proc.contract))
        await asyncio.shield(proc.exited)

    def _model_store(self, contract: ModelContract) -> WeightStore | None:
        """The node's store where `contract`'s weights are in one (None: not, or it cannot be opened)."""
        if contract.store_ref is None:
            return None
        try:
            return self._weights.store(contract)
        except EmberError:
            return None

    def _store_roots(self) -> set[Path]:
        """The weight stores this node's instances may use: its own, and the default one in their environment."""
        config = self._weights.config
        return {*([] if config is None else [config.root]), default_root(self._env())}

    @staticmethod
    def _contract_json(contract: ModelContract) -> dict[str, Any]:
        return contract.model_dump(mode="json")
