"""Two instances of the node, same name, in namespaces /car1 and /car2 on one DDS domain
(`litevlm drive --namespace`), each fed its own camera frames and questions: each answers only
its own, from its own frames, and /diagnostics tells them apart."""

from __future__ import annotations

from helpers.ros import Proc, Rig, RosClient, domain_id, ros_env, write_params


def test_two_namespaced_instances_do_not_cross_talk(tmp_path, tiny_model):
    from diagnostic_msgs.msg import DiagnosticArray

    domain = domain_id(8)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=2)
    nodes = {ns: Proc(["drive", "--params", str(params), "--namespace", ns], ros_env(domain), tmp_path / f"{ns}.log")
             for ns in ("car1", "car2")}
    client = RosClient(domain)
    try:
        rigs = {ns: Rig(client, f"/{ns}") for ns in nodes}
        diags = []
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 50)
        for ns, node in nodes.items():
            node.wait_for("ready (active)", timeout=120)
        assert client.spin_until(lambda: all(r.connected() for r in rigs.values()), 30)
        client.spin_for(0.5)
        stamps = {ns: [] for ns in nodes}
        for rnd in range(3):
            for k, (ns, rig) in enumerate(rigs.items()):
                stamps[ns].append(rig.frames(seed=100 * k + rnd))
                client.spin_for(0.05)
            client.spin_for(0.2)
            for ns, rig in rigs.items():
                rig.ask(f"{ns}-q{rnd}", f"What is in front of {ns}?")
            assert client.spin_until(lambda: all(len(r.answers) > rnd for r in rigs.values()), 30)
        rigs["car2"].frames(seed=7, stamp_ns=stamps["car2"][-1])    # the same stamp again: dropped by the store
        client.spin_for(1.0)                                     # anything misrouted would have arrived

        for ns, rig in rigs.items():
            ids = [a.query_id for a in rig.answers]
            assert ids == [f"{ns}-q{i}" for i in range(3)], ids            # its own questions, each once
            ok = [a for a in rig.answers if a.status == 0]
            assert ok, [a.status_message for a in rig.answers]
            for a in ok:                                                   # matched to its own frames
                assert {s.sec * 10 ** 9 + s.nanosec for s in a.frame_stamps} <= set(stamps[ns])

        latest = {}
        assert client.spin_until(lambda: {s.name.split(":")[0] for d in diags for s in d.status}
                                 >= {"/car1/litevlm_drive", "/car2/litevlm_drive"}, 10)
        for d in diags:
            for st in d.status:
                latest[st.name.split(":")[0]] = {kv.key: kv.value for kv in st.values}
        for ns in nodes:
            v = latest[f"/{ns}/litevlm_drive"]
            assert v["camera.CAM_FRONT.topic"] == f"/{ns}/cam_front/image_raw/compressed"
            received, dropped = int(v["camera.CAM_BACK.received"]), int(v["camera.CAM_BACK.dropped"])
            assert (1 <= received <= 3 and dropped == 0) if ns == "car1" else (received >= 2 and dropped >= 1), v
            assert float(v["camera.CAM_FRONT.rate_hz"]) > 0 and float(v["camera.CAM_FRONT.newest_frame_age_s"]) >= 0
            assert v["model"] == str(tiny_model)
    finally:
        client.close()
        for node in nodes.values():
            node.stop()
