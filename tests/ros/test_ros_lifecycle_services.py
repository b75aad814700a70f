"""The node's services while a transition runs, and lifecycle shutdown ending the process, over
real DDS as `ros2 lifecycle` / `ros2 param` drive them: `get_state` answers and says
"configuring" while configure loads the model (a reply in milliseconds, where it used to wait
for the whole transition), parameter services answer too, and `shutdown`
finalizes the node and ends the process (what `ros2 launch` expects of a node that exits)."""

from __future__ import annotations

import time

from helpers.ros import RosClient, domain_id, write_params
from test_ros_node import start_node

NAME = "/litevlm_drive"


def test_services_answer_while_configure_runs_and_shutdown_ends_the_process(tmp_path):
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    from rcl_interfaces.srv import ListParameters

    domain = domain_id(18)
    # The bundled model with its warm-up: configure takes seconds here (12-15 s on 2 cores).
    params = write_params(tmp_path / "p.yaml", warmup=True)
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    try:
        assert client.lifecycle_get(NAME) == "unconfigured"
        change = client.node.create_client(ChangeState, f"{NAME}/change_state")
        assert client.spin_until(change.service_is_ready, 30)
        client.spin_for(1.0)
        req = ChangeState.Request()
        req.transition.id = Transition.TRANSITION_CONFIGURE
        configured = change.call_async(req)
        get_state = client.node.create_client(GetState, f"{NAME}/get_state")
        params_list = client.node.create_client(ListParameters, f"{NAME}/list_parameters")
        assert client.spin_until(lambda: get_state.service_is_ready() and params_list.service_is_ready(), 30)
        seen, delays = [], []
        while not configured.done():
            # asked again every 5 s: a reply can be lost while discovery finishes (RosClient.ask);
            # None: configure ended before any reply (services blocked by it answer only then)
            t0 = time.monotonic()
            state = client.ask(get_state, GetState.Request(), timeout=120, unless=configured.done)
            if state is None:
                break
            delays.append(time.monotonic() - t0)
            seen.append(state.current_state.label)
            if seen[-1] == "configuring" and seen.count("configuring") == 2:
                listed = client.ask(params_list, ListParameters.Request(), timeout=120, unless=configured.done)
                assert listed is not None and not configured.done(), "list_parameters blocked until configure ended"
                assert "model_dir" in listed.result.names
            client.spin_for(0.2)
        assert configured.result().success, node.text()[-3000:]
        # Answered while configure ran (its replies name the transition state), not after it. How
        # fast is the machine's business (quiet: milliseconds; the note has figures), not the test's.
        assert seen.count("configuring") >= 3, seen
        print(f"get_state during configure: {len(seen)} calls, slowest {max(delays) * 1000:.0f} ms")
        assert client.lifecycle_get(NAME) == "inactive"
        # shutdown: finalized, then the process ends by itself with its summary
        assert client.lifecycle_set(NAME, "shutdown")
        assert node.wait(30) == 0, node.text()[-3000:]
        text = node.text()
        assert "shutdown: finalized; the process ends" in text and "summary:" in text
        assert "Traceback" not in text
    finally:
        client.close()
        node.stop()


def configuring_node(tmp_path, k: int, into_s: float = 1.0):
    """The node executable with the bundled model and its warm-up (a configure of seconds), asked to
    configure (the launch file's request); returns (node, client, the pending configure) `into_s`
    seconds after the node logged that it loads."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    domain = domain_id(k)
    node = start_node(tmp_path, domain, "/", write_params(tmp_path / "p.yaml", warmup=True))
    client = RosClient(domain)
    change = client.node.create_client(ChangeState, f"{NAME}/change_state")
    assert client.spin_until(change.service_is_ready, 60)
    client.spin_for(1.0)
    req = ChangeState.Request()
    req.transition.id = Transition.TRANSITION_CONFIGURE
    configured = change.call_async(req)
    end = time.monotonic() + 120
    while "configure: loading" not in node.text() and time.monotonic() < end:
        client.spin_for(0.05)
    client.spin_for(into_s)                                # into configure
    return node, client, configured


def test_ctrl_c_during_configure_cancels_it_and_exits_cleanly(tmp_path):
    """SIGINT 1 s into configure: the load stops (serving/cancel.py) instead of running to its end
    under launch's 5 s SIGTERM timeout (it used to log its summary, then load on for 5-6 s with the
    bundled model, minutes with a 2B one): the process exits 0 with a line saying configure was
    cancelled, and the model never finished loading. (The time it takes is tests/ros/test_ros_launch_real.py's,
    with the real CLI.)"""
    import signal

    node, client, _ = configuring_node(tmp_path, 34)
    try:
        node.p.send_signal(signal.SIGINT)
        assert node.wait(60) == 0, node.text()[-3000:]
        text = node.text()
        assert "configure cancelled (SIGINT" in text and "summary:" in text, text[-3000:]
        assert "model loaded and warmed up" not in text, text[-3000:]
        assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    finally:
        client.close()
        node.stop()


def test_lifecycle_shutdown_during_configure_cancels_it_and_ends_the_process(tmp_path):
    """`ros2 lifecycle set /litevlm_drive shutdown` while configure runs: rcl has no shutdown out of
    `configuring`, so the CLI (which lists the available transitions first) refused it and the
    load ran on. The node offers shutdown there, cancels configure, and shuts down: the reply is
    success, the process exits 0, and the model never finished loading."""
    from lifecycle_msgs.srv import GetAvailableTransitions

    # 0.2 s in: the two service calls below must land before the load and warm-up end; 1 s in, on a
    # quiet Zen 4 in CI, configure had already succeeded when the shutdown arrived (a lost race, not
    # the behaviour under test)
    node, client, configured = configuring_node(tmp_path, 35, into_s=0.2)
    try:
        listed = client.call(GetAvailableTransitions, f"{NAME}/get_available_transitions",
                             GetAvailableTransitions.Request())
        labels = [t.transition.label for t in listed.available_transitions]
        assert "shutdown" in labels, labels
        assert client.lifecycle_set(NAME, "shutdown"), node.text()[-3000:]
        assert node.wait(60) == 0, node.text()[-3000:]
        # (its reply left before the process ended; this client still has to take it from its reader)
        assert client.spin_until(configured.done, 30) and not configured.result().success   # configure: failed
        text = node.text()
        assert "configure cancelled (lifecycle shutdown" in text and "shutdown: finalized" in text, text[-3000:]
        assert "model loaded and warmed up" not in text and "summary:" in text, text[-3000:]
    finally:
        client.close()
        node.stop()
