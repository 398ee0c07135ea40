"""The autoscaled cluster's pieces that need no Ray running: the autoscaler's config, the namespaces' command, and
the refusal to start outside them (its clean-up is `ray stop --force`)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from ember.cluster.autoscaling import (
    MARKER,
    WORKER_TYPE,
    AutoscaledCluster,
    AutoscalerSettings,
    autoscaler_env,
    autoscaling_config,
    in_own_namespace,
    namespaced,
)


def test_the_config_names_the_fake_provider_a_cpu_less_head_and_one_worker_type_from_zero() -> None:
    config = autoscaling_config(AutoscalerSettings(max_workers=3, idle_timeout_s=9.0))
    assert config["provider"]["type"] == "fake_multinode"
    assert config["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 0}
    worker = config["available_node_types"][WORKER_TYPE]
    assert (worker["resources"], worker["min_workers"], worker["max_workers"]) == ({"CPU": 1}, 0, 3)
    assert config["idle_timeout_minutes"] == pytest.approx(0.15)
    assert autoscaler_env(AutoscalerSettings())["RAY_FAKE_CLUSTER"] == "1"


def test_v2_names_the_same_provider_as_an_external_one_and_switches_the_monitor() -> None:
    settings = AutoscalerSettings(v2=True)
    provider = autoscaling_config(settings)["provider"]
    assert provider["type"] == "external" and provider["module"].endswith("FakeMultiNodeProvider")
    assert autoscaler_env(settings)["RAY_enable_autoscaler_v2"] == "1"
    assert "RAY_enable_autoscaler_v2" not in autoscaler_env(AutoscalerSettings())


def test_the_command_runs_in_new_pid_mount_and_network_namespaces_with_loopback_up() -> None:
    cmd = namespaced(["python", "-m", "x"])
    assert cmd[:6] == ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--mount"]
    assert f"{MARKER}=1" in cmd and cmd[-3:] == ["python", "-m", "x"]
    assert "ip link set lo up" in cmd[cmd.index("-c") + 1]


def test_it_refuses_to_start_outside_namespaces_of_its_own(tmp_path: Path) -> None:
    assert not in_own_namespace()          # this test's process: the machine's network, no marker
    with pytest.raises(RuntimeError, match="namespaces of its own"):
        AutoscaledCluster(tmp_path, [], []).start()
    assert not (tmp_path / "autoscaling.json").exists()
