"""`ember sim`: run keep-alive policies over a trace (or a synthetic day) and report their trade-offs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ember.errors import InvalidInput

DEFAULT_POLICIES = "fixed,fixed-zygote,hybrid,hybrid-zygote,ladder,rainbowcake,faascache"


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "sim", help="simulate keep-alive policies over a trace",
        description="Simulate keep-alive policies over a trace (default: a synthetic Azure-2019-like day) and "
                    "print cold starts by rung, start latency and idle memory; writes sim.json and frontiers.png.")
    parser.add_argument("--trace", help="trace file or directory (e.g. ../shared/traces/azure-llm-2023)")
    parser.add_argument("--format", choices=("azure2019", "azure2021", "azurellm"),
                        help="trace format (guessed from the header when omitted)")
    parser.add_argument("--synthetic-apps", type=int, default=1000, help="apps in the synthetic day (no --trace)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the synthetic trace and minute placement")
    parser.add_argument("--out", default="state/sim", help="directory for sim.json and frontiers.png")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated: fixed, fixed-zygote, hybrid, hybrid-zygote, ladder, ladder-cold (the "
                             "ladder swept along cold_value, MB*s per cold start), rainbowcake, "
                             "faascache (shared node, knob budget_gb), lru-evict (the same node, ember's LRU victim), "
                             "lp-buffer (the same node sized by the LP planner every minute)")
    parser.add_argument("--knob", action="append", default=[], metavar="POLICY.NAME=VALUE",
                        help="set a policy knob, e.g. fixed.keep_alive_s=300 (repeatable)")
    parser.add_argument("--no-sweep", action="store_true", help="only each policy's configured knob")
    parser.add_argument("--runtimes", type=int, default=2,
                        help="runtimes the apps are spread over; each runtime's zygote is shared (ember has 2)")
    parser.add_argument("--rung-costs", help="JSON of measured rung costs (bench/cold_start.py output)")
    parser.add_argument("--restore-s", type=float, metavar="S",
                        help="nothing kept in memory is a restore from a process image taking S seconds, for every "
                             "policy, baselines too (ember serve --snapshots on; 0.17: bench/restore.py's MiniLM)")
    parser.add_argument("--write-synthetic", metavar="DIR", help="also write the synthetic day as 2019 CSV files")
    parser.add_argument("--placement", choices=("even", "poisson"),
                        help="a 2019 minute's arrivals: evenly spaced (default) or uniform random times within the "
                             "minute (Poisson given the count; the default with --tune-on)")
    parser.add_argument("--tune-on", action="append", default=[], metavar="TRACE",
                        help="held-out evaluation: tune the ladder's constants on TRACE (repeatable), then report "
                             "every policy on each --held-out trace; writes heldout.json and one PNG per trace")
    parser.add_argument("--held-out", action="append", default=[], metavar="TRACE",
                        help="a trace to report on with --tune-on (repeatable; 'synthetic' for the synthetic day "
                             "of --synthetic-apps apps and --seed; a tuning trace is never reported on its tuning)")
    parser.add_argument("--tune-grid", action="append", default=[], metavar="NAME=V1,V2,...",
                        help="with --tune-on: search only these ladder constants over these values (repeatable; "
                             "default: the grid in ember/sim/heldout.py)")
    parser.add_argument("--keepalive-preset", metavar="FILE",
                        help="the ladder's constants (JSON {\"name\": ..., \"constants\": {...}}, as `ember serve "
                             "--keepalive-preset` takes); default: the preset `ember serve --keepalive ladder` runs")
    parser.add_argument("--write-preset", metavar="FILE",
                        help="write the ladder's preset (the default, or --keepalive-preset's) as a JSON file")
    parser.add_argument("--verdict", metavar="OUT_JSON",
                        help="judge the ladder by the envelope yardstick (docs/policies.md, 'The verdict'): every "
                             "policy's sweep with its real knobs on --trace, per pair (atc, latency, p99) and end rule "
                             "max_eps, geo_saving, ci_low, ci_high against the pooled baselines and each one; writes "
                             "OUT_JSON and prints the table")
    parser.add_argument("--resamples", type=int, default=200,
                        help="with --verdict: bootstrap resamples over applications for the saving's interval")
    parser.add_argument("--report", metavar="HELDOUT_JSON",
                        help="print the held-out table of a stored run, its verdicts judged again by this code from "
                             "its stored points (nothing is simulated)")
    parser.set_defaults(func=_run)


def parse_knobs(specs: list[str]) -> dict[str, dict[str, float]]:
    knobs: dict[str, dict[str, float]] = {}
    for spec in specs:
        name, eq, value = spec.partition("=")
        policy, dot, knob = name.partition(".")
        if not (eq and dot and policy and knob):
            raise InvalidInput(f"--knob {spec!r}: expected POLICY.NAME=VALUE, e.g. fixed.keep_alive_s=300")
        try:
            knobs.setdefault(policy, {})[knob] = float(value)
        except ValueError:
            raise InvalidInput(f"--knob {spec!r}: {knob}: not a number: {value!r}") from None
    return knobs


def parse_grid(specs: list[str]) -> dict[str, tuple[float, ...]] | None:
    if not specs:
        return None
    grid: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        name, eq, values = spec.partition("=")
        if not (eq and name and values):
            raise InvalidInput(f"--tune-grid {spec!r}: expected NAME=V1,V2,..., e.g. smooth_weight=0,1,4")
        try:
            grid[name.strip()] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise InvalidInput(f"--tune-grid {spec!r}: {name}: not a list of numbers: {values!r}") from None
    return grid


def _costs(path: str | None, restore_s: float | None = None) -> Any:
    from ember.core.rung_costs import RungCosts

    costs = RungCosts() if path is None else RungCosts.from_benchmark(_read_json("--rung-costs", path))
    if restore_s is None:
        return costs
    if not 0 <= restore_s <= 3600:
        raise InvalidInput(f"--restore-s: {restore_s:g} is not a restore time in seconds (0 to 3600)")
    return costs.with_restore(restore_s)


def _read_json(flag: str, path: str) -> Any:
    from ember.config import read_json

    return read_json(flag, path)


def _trace(args: argparse.Namespace) -> Any:
    from ember.sim.synthetic import SyntheticConfig, generate_day, write_azure2019
    from ember.sim.traces import read_trace, sniff_format, trace_from_2019

    if args.trace:
        return read_trace(args.trace, args.format or sniff_format(args.trace), seed=args.seed,
                          placement=args.placement or "even")
    if args.format:
        raise InvalidInput("--format needs --trace")
    config = SyntheticConfig(apps=args.synthetic_apps, seed=args.seed)
    day = generate_day(config)
    if args.write_synthetic:
        print(f"wrote {write_azure2019(day, Path(args.write_synthetic))}")
    return trace_from_2019(day, name=f"synthetic-{config.apps}apps-seed{config.seed}", seed=config.seed,
                           placement=args.placement or "even")


def _run(args: argparse.Namespace) -> int:
    from ember.sim.report import build_report, plot, table, write_json
    from ember.sim.runner import MAX_RUNTIMES, build_policies, ladder_share, run_policies

    if not 1 <= args.runtimes <= MAX_RUNTIMES:
        raise InvalidInput(f"--runtimes must lie in [1, {MAX_RUNTIMES:,}], got {args.runtimes}")
    if not 0 <= args.seed < 2**63:                 # (numpy's generators take no negative seed)
        raise InvalidInput(f"--seed must lie in [0, 2**63), got {args.seed}")
    if args.report:
        return _report(args.report)
    if args.tune_on:
        return _run_heldout(args)
    if args.write_preset:
        import json

        from ember.keepalive.preset import document

        Path(args.write_preset).write_text(json.dumps(document(_preset(args)), indent=1) + "\n")
        print(f"wrote {args.write_preset}")
        return 0
    if args.verdict:
        return _run_verdict(args)
    if args.held_out:
        raise InvalidInput("--held-out needs --tune-on TRACE")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:
        raise InvalidInput("--policies: name at least one policy (e.g. fixed, hybrid, ladder, rainbowcake, faascache)")
    costs = _costs(args.rung_costs, args.restore_s)
    knobs = parse_knobs(args.knob)
    trace = _trace(args)
    policies = build_policies(names, knobs, costs, ladder_share(trace, args.runtimes), _preset(args))
    sweeps = run_policies(trace, policies, costs, runtimes=args.runtimes, sweep=not args.no_sweep)
    report = build_report(trace, sweeps, costs, runtimes=args.runtimes, seed=args.seed, policies=names,
                          knobs=knobs, sweep=not args.no_sweep)
    out = Path(args.out)
    write_json(report, out / "sim.json")
    plot(report, out / "frontiers.png")
    print(table(report))
    print(f"wrote {out / 'sim.json'} and {out / 'frontiers.png'}")
    return 0


def _report(path: str) -> int:
    from ember.sim.heldout import rejudge
    from ember.sim.heldout_report import table

    result = _read_json("--report", path)
    try:
        text = table(rejudge(result))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, ArithmeticError) as err:
        raise InvalidInput(f"--report {path}: not a held-out run's heldout.json ({type(err).__name__}: {err})"
                           ) from None
    print(text)
    return 0


def _run_heldout(args: argparse.Namespace) -> int:
    from ember.sim.heldout import SYNTHETIC, check_grid, evaluate, load
    from ember.sim.heldout_report import plot, table
    from ember.sim.report import write_json

    if args.trace or args.knob or args.no_sweep or args.policies != DEFAULT_POLICIES:
        raise InvalidInput("--tune-on: give the traces with --held-out; every registered policy is swept in full "
                           "(--trace, --knob, --no-sweep and --policies do not apply)")
    placement = args.placement or "poisson"
    grid = parse_grid(args.tune_grid)

    def get(spec: str) -> Any:
        return load(spec, placement=placement, seed=args.seed, synthetic_apps=args.synthetic_apps)

    check_grid(grid)
    tuning = [get(t) for t in args.tune_on]
    held = [get(t) for t in (args.held_out or [SYNTHETIC])]
    if {h.source for h in held} <= {t.source for t in tuning}:
        raise InvalidInput("--held-out: every held-out trace is a tuning trace; name another")
    result = evaluate(tuning, held, _costs(args.rung_costs, args.restore_s), args.runtimes, grid)
    result["settings"] = {"runtimes": args.runtimes, "seed": args.seed, "placement": placement,
                          "synthetic_apps": args.synthetic_apps, "tune_on": args.tune_on,
                          "held_out": args.held_out or [SYNTHETIC]}
    out = Path(args.out)
    write_json(result, out / "heldout.json")
    for label, entry in result["traces"].items():
        plot(label, entry, out / f"{label}.png")
    print(table(result))
    print(f"wrote {out / 'heldout.json'} and {len(result['traces'])} PNG(s) in {out}")
    return 0


def _run_verdict(args: argparse.Namespace) -> int:
    import json
    import time

    from ember.sim.envelopes import BASELINES, LADDERS, judge, summary, sweep_all, table

    if not args.trace:
        raise InvalidInput("--verdict needs --trace DIR (a day of the 2019 trace, or any trace `ember sim` reads)")
    if args.knob or args.no_sweep or args.policies != DEFAULT_POLICIES:
        raise InvalidInput("--verdict: every baseline is swept with its real knobs and the ladder with its preset "
                           "(--knob, --no-sweep and --policies do not apply)")
    if not 10 <= args.resamples <= 100_000:
        raise InvalidInput(f"--resamples must lie in [10, 100000], got {args.resamples}")
    began = time.perf_counter()
    costs = _costs(args.rung_costs, args.restore_s)
    trace = _trace(args)
    points = sweep_all(trace, costs, args.runtimes, [*BASELINES, *LADDERS], ladder=_ladder(args),
                       progress=lambda line: print(line, flush=True))
    verdict = judge(points, costs, resamples=args.resamples, seed=args.seed)
    out = Path(args.verdict)
    doc = {"trace": {"name": trace.name, "format": trace.format, "apps": len(trace.apps),
                     "invocations": trace.invocations, "horizon_s": trace.horizon_s},
           "settings": {"runtimes": args.runtimes, "seed": args.seed, "resamples": args.resamples,
                        "placement": args.placement or "even"},
           "verdict": verdict, "points": summary(points, costs), "wall_s": time.perf_counter() - began}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(table(verdict))
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0


def _ladder(args: argparse.Namespace) -> Any:
    """The ladder the verdict judges: the preset's (`--keepalive-preset FILE`, else the default preset)."""
    return _preset(args).ladder()


def _preset(args: argparse.Namespace) -> Any:
    from ember.config import load_preset

    return load_preset(args.keepalive_preset)
