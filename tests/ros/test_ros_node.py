"""The node as a ROS user meets it, over real DDS: the executable launch_ros starts
(`litevlm_drive_node`, here from the source tree), driven through the lifecycle services as the
launch file's event handler and `ros2 lifecycle set` drive it; parameters described, set and
refused through the parameter services as `ros2 param` uses them; bad start values failing
configure with the process up; topic names resolved as rcl resolves them."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from helpers.ros import Proc, RosClient, domain_id, ros_env, write_params

from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.parameters import AT_CONFIGURE, CONFIGURE_NOTE, LIVE_NOTE
from litevlm_runtime.ros.topics import SHIPPED_REMAPS, resolve

ROOT = Path(__file__).resolve().parents[2]
NODE_MAIN = "import sys; from litevlm_runtime.ros.runner import main; sys.exit(main())"


def launch_handler() -> dict:
    """The keywords of the launch file's OnStateTransition (string constants only)."""
    tree = ast.parse((ROOT / "launch" / "drive.launch.py").read_text())
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "OnStateTransition"
    ]
    assert len(calls) == 1
    handler = {k.arg: k.value.value for k in calls[0].keywords if isinstance(k.value, ast.Constant)}
    assert handler.get("handle_once") is True and "goal_state" not in handler      # the outcome is checked inside
    return handler


def handler_matches(handler: dict, event) -> bool:
    """launch_ros' OnStateTransition matcher (event_handlers/on_state_transition.py): every option
    given must equal the event's label; an option not given is not compared."""
    return all(handler.get(key) is None or handler[key] == label
               for key, label in (("transition", event.transition.label), ("start_state", event.start_state.label),
                                  ("goal_state", event.goal_state.label)))


def launch_activations(handler: dict, events) -> int:
    """How many activate requests the launch file's handler makes for these transition events:
    launch's EventHandler with handle_once takes the first matching event only, and the launch
    file's activate_if_configured activates when that event's goal is inactive."""
    matching = [e for e in events if handler_matches(handler, e)]
    if handler.get("handle_once"):
        matching = matching[:1]
    return sum(e.goal_state.label == "inactive" for e in matching)


def start_node(tmp_path: Path, domain: int, namespace: str, params: Path, *extra: str, env: dict | None = None) -> Proc:
    """As launch_ros runs it: the executable, then --ros-args with name, namespace, params, remaps
    (`env`: the process's environment, default ros_env(domain))."""
    remaps = [a for src, dst in SHIPPED_REMAPS for a in ("-r", f"{src}:={dst}")]
    cmd = [sys.executable, "-c", NODE_MAIN, "--ros-args", "-r", "__node:=litevlm_drive", "-r", f"__ns:={namespace}",
           "--params-file", str(params), *remaps, *extra]
    return Proc([], env or ros_env(domain), tmp_path / "node.log", cmd=cmd)


def test_topic_resolution_is_rcls():
    """topics.resolve (for the bag tools) against rclpy's Node.resolve_topic_name (rcl)."""
    import rclpy

    cases = ["query", "answer_json", "cam_front/image_raw/compressed", "/diagnostics", "~/status", "/abs/query"]
    for ns, user in (
        ("/", ()),
        ("/car1", ()),
        ("/a/b", (("query", "/elsewhere/q"), ("cam_back/image_raw", "back/raw"))),
    ):
        remaps = (*user, *SHIPPED_REMAPS)
        args = ["x", "--ros-args", "-r", f"__ns:={ns}"] + [a for s, d in remaps for a in ("-r", f"{s}:={d}")]
        ctx = rclpy.Context()
        rclpy.init(args=args, context=ctx)
        try:
            node = rclpy.create_node("litevlm_drive", context=ctx)
            for name in [*cases, "cam_back/image_raw"]:
                assert resolve(name, ns, remaps) == node.resolve_topic_name(name), (ns, name)
            node.destroy_node()
        finally:
            rclpy.shutdown(context=ctx)
    assert resolve("query") == "/litevlm/query" and resolve("query", "/car1") == "/car1/litevlm/query"


def test_lifecycle_and_parameters_as_the_ros2_cli_sees_them(tmp_path, tiny_model):
    from diagnostic_msgs.msg import DiagnosticArray
    from lifecycle_msgs.msg import TransitionEvent
    from rcl_interfaces.msg import ParameterType

    domain = domain_id(5)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=2)
    node = start_node(tmp_path, domain, "/t5", params)
    client = RosClient(domain)
    name = "/t5/litevlm_drive"
    try:
        events, diags = [], []
        client.node.create_subscription(TransitionEvent, f"{name}/transition_event", events.append, 10)
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        handler = launch_handler()
        assert client.lifecycle_get(name) == "unconfigured"

        # The launch file: configure, then activate when the handler matches a transition event.
        assert client.lifecycle_set(name, "configure")
        assert client.spin_until(lambda: any(handler_matches(handler, e) for e in events), 30), \
            [(e.start_state.label, e.goal_state.label) for e in events]
        assert client.lifecycle_set(name, "activate")
        assert client.lifecycle_get(name) == "active"

        # `ros2 lifecycle set deactivate`: the handler must not fire again, so the node stays inactive.
        seen = len(events)
        assert client.lifecycle_set(name, "deactivate")
        client.spin_for(1.5)
        later = events[seen:]
        assert [(e.start_state.label, e.goal_state.label) for e in later] == [("active", "deactivating"),
                                                                             ("deactivating", "inactive")]
        assert not any(handler_matches(handler, e) for e in later)
        assert any(handler_matches({"goal_state": "inactive"}, e) for e in later)   # issue 2's handler would have
        assert client.lifecycle_get(name) == "inactive"
        # cleanup and a manual configure: it matches the handler's options, but the handler took
        # its one event (the launch's configure), so the launch activates once in all.
        assert client.lifecycle_set(name, "cleanup") and client.lifecycle_set(name, "configure")
        client.spin_for(1.0)
        assert any(handler_matches(handler, e) for e in events[seen:])       # issue 21: this one used to activate
        assert launch_activations(handler, events) == 1
        assert client.lifecycle_get(name) == "inactive"

        # Parameters: descriptors (`ros2 param describe`).
        d = {x.name: x for x in client.param_describe(name, ["queue_size", "overflow_policy", "max_skew_s",
                                                             "model_dir", "camera_topics", "tokens.keep_ratio"])}
        assert d["queue_size"].type == ParameterType.PARAMETER_INTEGER and not d["queue_size"].read_only
        assert (d["queue_size"].integer_range[0].from_value, d["queue_size"].integer_range[0].to_value) == (1, 10000)
        assert d["max_skew_s"].floating_point_range[0].to_value == 60.0 and d["max_skew_s"].description
        assert "drop_oldest" in d["overflow_policy"].additional_constraints
        assert not any(x.read_only for x in d.values())       # rclpy-read-only would refuse them unconfigured too
        assert d["model_dir"].description.endswith(CONFIGURE_NOTE) and d["tokens.keep_ratio"].description.endswith(
            CONFIGURE_NOTE) and d["queue_size"].description.endswith(LIVE_NOTE)
        assert d["camera_topics"].type == ParameterType.PARAMETER_STRING_ARRAY
        assert client.param_get(name, "camera_topics")[0] == "cam_front/image_raw/compressed"

        # `ros2 param set`: live ones applied, the rest refused with a reason.
        ok = client.param_set(name, "queue_size", 2)
        assert ok.successful, ok.reason
        assert client.param_get(name, "queue_size") == 2
        for pname, value, why in (("overflow_policy", "bogus", "not one of 'reject_new', 'drop_oldest'"),
                                  ("queue_size", 0, "out of range"),
                                  ("queue_size", "four", "Wrong parameter type"),
                                  ("model_dir", "/elsewhere", AT_CONFIGURE),
                                  ("tokens.keep_ratio", 0.5, AT_CONFIGURE),
                                  ("serving.latency_budget_ms", 100.0, AT_CONFIGURE)):
            r = client.param_set(name, pname, value)
            assert not r.successful and why in r.reason, (pname, value, r.reason)
        assert client.param_get(name, "overflow_policy") == "reject_new"
        assert client.param_set(name, "overflow_policy", "drop_oldest").successful
        diags.clear()
        assert client.spin_until(lambda: diags, 10)
        values = {kv.key: kv.value for kv in diags[-1].status[0].values}
        assert values["queue_size"] == "2" and values["overflow_policy"] == "drop_oldest"   # the server has them
        assert diags[-1].status[0].name.startswith(name + ":")
        assert values["model"] == str(tiny_model)

        assert client.lifecycle_set(name, "cleanup")
        assert client.lifecycle_get(name) == "unconfigured"
        assert node.alive()
    finally:
        client.close()
        node.stop()


def test_bad_start_values_fail_configure_and_the_process_stays_up(tmp_path, tiny_model):
    """A params file rclpy would refuse in the constructor (out of range, int for a double) and
    a value outside the choices: configure fails naming each, /diagnostics says so, questions
    are still answered; fixed live, configure succeeds."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    domain = domain_id(6)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=2,
                          queue_size=0, max_skew_s=1, overflow_policy="bogus")
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    name = "/litevlm_drive"
    try:
        diags, answers = [], []
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        client.node.create_subscription(
            String, "/litevlm/answer_json", lambda m: answers.append(json.loads(m.data)), qos
        )
        from lifecycle_msgs.msg import TransitionEvent

        events = []
        client.node.create_subscription(TransitionEvent, f"{name}/transition_event", events.append, 10)
        client.spin_for(1.0)
        assert not client.lifecycle_set(name, "configure")
        assert client.lifecycle_get(name) == "unconfigured" and node.alive()
        log = node.text()
        assert "configure failed: bad parameter" in log and "queue_size" in log and "max_skew_s" in log
        assert client.spin_until(lambda: diags and diags[-1].status[0].level == DiagnosticStatus.ERROR, 10)
        st = diags[-1].status[0]
        assert "configure failed" in st.message and "queue_size" in st.message
        assert {kv.key: kv.value for kv in st.values}["model"] == str(tiny_model)

        pub = client.node.create_publisher(String, "/litevlm/question", qos)
        assert client.spin_until(lambda: pub.get_subscription_count() > 0, 30)
        pub.publish(String(data="Anything in front?"))
        assert client.spin_until(lambda: answers, 30)
        assert answers[0]["status"] == "not_active"

        # overflow_policy passed rclpy (a string) but fails configure's validation.
        for pname, value in (("queue_size", 3), ("max_skew_s", 0.1)):
            assert client.param_set(name, pname, value).successful
        assert not client.lifecycle_set(name, "configure")
        assert "overflow_policy: 'bogus' is not one of" in node.text()
        assert client.param_set(name, "overflow_policy", "reject_new").successful
        assert client.lifecycle_set(name, "configure")
        assert client.lifecycle_get(name) == "inactive"
        # Under ros2 launch the first event was the launch's failed configure: the fixed one the
        # user requested leaves the node inactive (no auto-activation).
        client.spin_for(1.0)
        assert events and events[0].goal_state.label == "configuring"
        assert launch_activations(launch_handler(), events) == 0
    finally:
        client.close()
        node.stop()


def test_a_misspelt_key_in_the_params_file_fails_configure(tmp_path, tiny_model):
    """rclpy drops an override the node never declares; under ros2 launch a typo would run the
    default silently. The node fails configure naming the key, and stays up."""
    domain = domain_id(9)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, queue_sise=3)
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    try:
        assert not client.lifecycle_set("/litevlm_drive", "configure")
        assert client.lifecycle_get("/litevlm_drive") == "unconfigured" and node.alive()
        assert "queue_sise: not a parameter of this node" in node.text()
    finally:
        client.close()
        node.stop()


def test_a_lost_change_state_reply_is_read_from_the_transition_events(tmp_path, tiny_model, monkeypatch):
    """RosClient.lifecycle_set sends change_state once; when its reply is lost (DDS discovery
    under load) it reads the outcome from the node's transition events. Every change_state reply
    is dropped here (the request still reaches the node): a failed configure, a fixed one and a
    cleanup still read as the node's state says."""
    from rclpy.task import Future

    ask = RosClient.ask

    def reply_lost(self, client, request, *args, **kwargs):
        if client.srv_name.endswith("/change_state"):
            send = client.call_async
            client.call_async = lambda req: (send(req), Future())[1]
        return ask(self, client, request, *args, **kwargs)

    monkeypatch.setattr(RosClient, "ask", reply_lost)
    domain = domain_id(47)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, queue_size=0)
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    name = "/litevlm_drive"
    try:
        assert not client.lifecycle_set(name, "configure")
        assert client.lifecycle_get(name) == "unconfigured" and "queue_size" in node.text()
        assert client.param_set(name, "queue_size", 2).successful
        assert client.lifecycle_set(name, "configure")
        assert client.lifecycle_get(name) == "inactive"
        assert client.lifecycle_set(name, "cleanup")
        assert client.lifecycle_get(name) == "unconfigured" and node.alive()
    finally:
        client.close()
        node.stop()


def test_live_queue_change_keeps_queued_queries(tiny_model):
    """apply_live shrinks the queue in place: queued queries are kept and served, none
    answered; QueryServer.apply_settings (configure) rebuilds the queue and answers those
    beyond the new size queue_full, so nothing is lost either way."""
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.options import PipelineOptions
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.serving.server import QueryServer as _S
    apply_live = _S.apply_live
    from litevlm_runtime.serving.frame_store import Frame
    from litevlm_runtime.serving.server import QueryServer
    from litevlm_runtime.serving.settings import ServerSettings

    pipeline = Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=2))

    def server():
        published = []
        s = QueryServer(ServerSettings(queue_size=4), published.append, clock_ns=lambda: 10 ** 9)
        s.pipeline, s.active = pipeline, True        # loaded, no worker: submit only queues
        for cam in CAMERAS:
            s.frames.add(Frame(cam, 10 ** 9, b""))
        for i in range(4):
            assert s.submit(QueryRequest(f"question {i}?", query_id=f"q{i}")) is not None
        return s, published

    s, published = server()
    apply_live(s, ServerSettings(queue_size=2, overflow_policy="reject_new", max_skew_s=0.05))
    assert s.frames.max_skew_ns == 50_000_000 and s.settings.queue_size == 2
    assert s.submit(QueryRequest("one more?", query_id="r0")) is None                   # 4 queued >= 2: refused at once
    assert [(r.query_id, r.status) for r in published] == [("r0", "queue_full")]
    assert "(2, policy reject_new)" in published[0].status_message
    assert [r.query_id for r in s.queue.drain()] == ["q0", "q1", "q2", "q3"]   # all kept, in order
    apply_live(s, ServerSettings(queue_size=2, overflow_policy="drop_oldest"))
    for i in range(3):
        s.submit(QueryRequest(f"again {i}?", query_id=f"r{i + 1}"))
    assert [r.query_id for r in published] == ["r0", "r1"]                 # the oldest answered queue_full

    rebuilt, published = server()
    rebuilt.apply_settings(ServerSettings(queue_size=2))
    assert [r.query_id for r in rebuilt.queue.drain()] == ["q0", "q1"]      # kept, in order
    assert [(r.query_id, r.status) for r in published] == [("q2", "queue_full"), ("q3", "queue_full")]


@pytest.mark.parametrize("bad, why", [({"camera_topics": ["a"] * 5}, "needs 6 topics"),
                                      ({"camera_topics": ["cam front"] * 6}, "not a valid topic name"),
                                      ({"overflow_policy": "bogus"}, "overflow_policy"),
                                      ({"queue_size": 0}, "queue_size: 0 is below its minimum 1"),
                                      ({"tokens.keep_ratio": 2.0}, "tokens.keep_ratio")])
def test_configure_validation_names_the_parameter(bad, why):
    from litevlm_runtime.errors import InputError
    from litevlm_runtime.ros.parameters import PARAMETERS, validate_values

    with pytest.raises(InputError, match=why):
        validate_values(dict(PARAMETERS) | bad)
