"""Reconfigure through the lifecycle, over real DDS, as a ROS user does it with `ros2 lifecycle
set` and `ros2 param set`: a pipeline setting changes with deactivate, cleanup, set, configure,
activate (no relaunch); refused with the project's reason while inactive or active; a wrong
model_dir that failed configure is fixed in place."""

from __future__ import annotations

from helpers.ros import Rig, RosClient, domain_id, write_params
from test_ros_node import start_node

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.ros.parameters import AT_CONFIGURE

NAME = "/litevlm_drive"


def answer_of(client: RosClient, rig: Rig, query_id: str, seed: int) -> dict:
    """Fresh frames, one question, its Answer (as a dict of the fields the test reads)."""
    rig.frames(seed)
    client.spin_for(0.3)
    rig.ask(query_id, "Is there a car in front?")
    assert client.spin_until(lambda: any(a.query_id == query_id for a in rig.answers), 60), query_id
    a = next(a for a in rig.answers if a.query_id == query_id)
    return {"status": a.status, "message": a.status_message, "pipeline": a.pipeline, "integrity": a.model_integrity}


def test_pipeline_setting_changes_through_cleanup_and_configure(tmp_path, tiny_model):
    domain = domain_id(24)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tmp_path / "no_such_model"), warmup=False,
                          max_new_tokens=2, **{"tokens.mode": "layer0", "tokens.keep_ratio": 0.8})
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    try:
        # A wrong model_dir fails configure; set it while unconfigured and configure again.
        assert not client.lifecycle_set(NAME, "configure")
        assert client.lifecycle_get(NAME) == "unconfigured" and node.alive()
        assert "no_such_model" in node.text()
        r = client.param_set(NAME, "model_dir", str(tiny_model))
        assert r.successful, r.reason
        assert client.lifecycle_set(NAME, "configure")
        assert client.lifecycle_set(NAME, "activate")
        rig = Rig(client)
        assert client.spin_until(rig.connected, 30)
        first = answer_of(client, rig, "before", 1)
        assert first["status"] == 0 and "tokens@0.8" in first["pipeline"], first

        # Active, then inactive: refused with the reason, the value unchanged.
        for state in ("active", "inactive"):
            r = client.param_set(NAME, "tokens.keep_ratio", 0.5)
            assert not r.successful and r.reason == f"tokens.keep_ratio: {AT_CONFIGURE}", (state, r.reason)
            if state == "active":
                assert client.lifecycle_set(NAME, "deactivate")
        assert client.param_get(NAME, "tokens.keep_ratio") == 0.8
        assert client.param_set(NAME, "queue_size", 3).successful            # a live one stays live

        assert client.lifecycle_set(NAME, "cleanup")
        r = client.param_set(NAME, "tokens.keep_ratio", 0.5)
        assert r.successful, r.reason
        # Validated at configure, naming the parameter: a bad choice fails it, the node stays up.
        assert client.param_set(NAME, "overflow_policy", "bogus").successful is False   # live: checked at once
        assert client.param_set(NAME, "tokens.mode", "bogus").successful           # applies at configure
        assert not client.lifecycle_set(NAME, "configure")
        assert "configure failed: bad parameter" in node.text() and "tokens.mode" in node.text().split(
            "configure failed: bad parameter")[-1]
        assert client.param_set(NAME, "tokens.mode", "layer0").successful
        assert client.lifecycle_set(NAME, "configure")
        assert client.lifecycle_set(NAME, "activate")
        assert client.spin_until(rig.connected, 30)
        second = answer_of(client, rig, "after", 2)
        assert second["status"] == 0 and "tokens@0.5" in second["pipeline"], second
        assert client.param_get(NAME, "queue_size") == 3

        # Counters that agree (issue 42): /diagnostics and the summary count alike, all since the
        # node started, and say so; the frame counter used to restart at configure ("24 answered
        # (0 errors); frames 0 received").
        from diagnostic_msgs.msg import DiagnosticArray

        diags = []
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        assert client.spin_until(lambda: diags, 10)
        values = {kv.key: kv.value for kv in diags[-1].status[0].values}
        assert values["answered"] == "2" and values["counted_since"].startswith("since the node started")
        assert "(2 configures)" in values["counted_since"], values["counted_since"]
        assert sum(int(values[f"camera.{c}.received"]) for c in CAMERAS) == 12, values
    finally:
        client.close()
        node.stop()
    summary = next(line for line in node.text().splitlines() if "summary:" in line)
    assert "summary: 2 answered (0 errors); frames 12 received" in summary, summary
    assert "all counted since the node started" in summary and "(2 configures)" in summary, summary


def test_require_manifest_and_the_integrity_report(tmp_path, tiny_model):
    """A folder without a manifest: refused under require_manifest with the command that writes
    one; served once it is off, /diagnostics and the configure log saying unverified."""
    import shutil

    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    from litevlm_runtime.weights.integrity import MANIFEST_FILE

    folder = tmp_path / "brought"
    shutil.copytree(tiny_model, folder)
    (folder / MANIFEST_FILE).unlink()
    domain = domain_id(27)
    params = write_params(tmp_path / "p.yaml", model_dir=str(folder), warmup=False, require_manifest=True)
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    try:
        diags = []
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        assert not client.lifecycle_set(NAME, "configure")
        assert f"then write the manifests with: litevlm checksum {folder}" in node.text()
        assert client.param_set(NAME, "require_manifest", False).successful
        assert client.lifecycle_set(NAME, "configure")
        assert "integrity: unverified (no manifest)" in node.text()
        assert "serving UNVERIFIED weights" in node.text()               # a warning, not only an info line
        # Said loudly (issue 42): /diagnostics warns while serving, and every answer carries it.
        assert client.lifecycle_set(NAME, "activate")
        rig = Rig(client)
        assert client.spin_until(rig.connected, 30)
        unverified = answer_of(client, rig, "unverified", 1)
        assert unverified["status"] == 0 and unverified["integrity"] == "unverified (no manifest)", unverified
        diags.clear()
        assert client.spin_until(lambda: diags, 10)
        status = diags[-1].status[0]
        assert {kv.key: kv.value for kv in status.values}["integrity"] == "unverified (no manifest)"
        assert status.level == DiagnosticStatus.WARN and "no manifest vouches for" in status.message, status.message
        assert client.lifecycle_set(NAME, "deactivate")
        assert client.lifecycle_set(NAME, "cleanup")
        assert client.param_set(NAME, "model_dir", str(tiny_model)).successful
        assert client.param_set(NAME, "require_manifest", True).successful
        assert client.lifecycle_set(NAME, "configure")
        assert "integrity: verified (manifest)" in node.text()
        assert client.lifecycle_set(NAME, "activate")
        assert client.spin_until(rig.connected, 30)
        assert answer_of(client, rig, "verified", 2)["integrity"] == "verified (manifest)"
    finally:
        client.close()
        node.stop()
