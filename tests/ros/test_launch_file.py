"""launch/drive.launch.py checked statically (launch and launch_ros are not installable here):
its arguments, the node action, the remappings and the DDS profile, read from its syntax tree.
What the lifecycle handler matches is checked against the node's real transition events in
test_ros_node.py."""

from __future__ import annotations

import ast
from pathlib import Path

from litevlm_runtime.ros.topics import SHIPPED_REMAPS

ROOT = Path(__file__).resolve().parents[2]
TREE = ast.parse((ROOT / "launch" / "drive.launch.py").read_text())


def calls(name: str) -> list[ast.Call]:
    return [n for n in ast.walk(TREE) if isinstance(n, ast.Call)
            and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) == name]


def kwargs(call: ast.Call) -> dict:
    return {k.arg: k.value for k in call.keywords}


def text(node) -> str:
    """A string constant, or a concatenation whose left part is one (a description built from a path)."""
    if isinstance(node, ast.Constant):
        return node.value
    assert isinstance(node, ast.BinOp), ast.dump(node)
    return text(node.left)


def is_config(node, name: str) -> bool:
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "LaunchConfiguration"
            and node.args[0].value == name)


def test_launch_arguments_are_declared_with_descriptions():
    args = {c.args[0].value: kwargs(c) for c in calls("DeclareLaunchArgument")}
    assert set(args) == {"namespace", "params_file", "model_dir", "log_level", "fastdds_profile", "auto_activate"}
    assert args["auto_activate"]["default_value"].value == "true"
    assert [e.value for e in args["auto_activate"]["choices"].elts] == ["true", "false"]
    for name, kw in args.items():
        assert len(text(kw["description"])) > 20, name            # what `ros2 launch --show-args` prints
    for name in ("namespace", "model_dir", "fastdds_profile"):
        assert args[name]["default_value"].value == "", name       # empty: the environment / the file decides
    assert [e.value for e in args["log_level"]["choices"].elts] == ["debug", "info", "warn", "error", "fatal"]


def test_dds_profile_is_set_only_when_given():
    setters = calls("SetEnvironmentVariable")
    assert len(setters) == 1 and setters[0].args[0].value == "FASTDDS_DEFAULT_PROFILES_FILE"
    cond = kwargs(setters[0])["condition"]
    assert getattr(cond.func, "attr", "") == "IfCondition"
    test = cond.args[0]
    assert getattr(test.func, "attr", "") == "NotEqualsSubstitution" and test.args[1].value == ""
    assert not calls("AppendEnvironmentVariable") and "os.environ" not in ast.unparse(TREE)


def test_node_action_namespace_remaps_log_level_and_transitions():
    node, = calls("LifecycleNode")
    kw = kwargs(node)
    assert (kw["package"].value, kw["executable"].value, kw["name"].value) == (
        "litevlm",
        "litevlm_drive_node",
        "litevlm_drive",
    )
    assert is_config(kw["namespace"], "namespace")
    assert ast.unparse(kw["ros_arguments"]).startswith(
        "['--log-level', launch.substitutions.LaunchConfiguration('log_level')"
    )
    assert kw["remappings"].id == "REMAPPINGS"
    remaps = next(n.value for n in TREE.body if isinstance(n, ast.Assign) and n.targets[0].id == "REMAPPINGS")
    assert tuple(ast.literal_eval(remaps)) == SHIPPED_REMAPS         # what `litevlm drive` applies
    handler, = calls("OnStateTransition")
    hk = kwargs(handler)
    # One event only (the launch's own configure), activating on its success only: a manual
    # configure later (after cleanup, or fixing what failed the launch's) leaves the node inactive.
    assert hk["start_state"].value == "configuring" and hk["handle_once"].value is True and "goal_state" not in hk
    assert "activate_if_configured" in ast.unparse(hk["entities"])
    decide = next(n for n in TREE.body if isinstance(n, ast.FunctionDef) and n.name == "activate_if_configured")
    assert "context.locals.event.goal_state == 'inactive'" in ast.unparse(decide)
    assert "TRANSITION_ACTIVATE" in ast.unparse(decide)
    register, = calls("RegisterEventHandler")
    cond = kwargs(register)["condition"]
    assert getattr(cond.func, "attr", "") == "IfCondition" and is_config(cond.args[0], "auto_activate")
    transitions = [ast.unparse(c) for c in calls("change_state")]
    assert sorted(t.split(".")[-1].rstrip(")") for t in transitions) == ["TRANSITION_ACTIVATE", "TRANSITION_CONFIGURE"]
    # parameters: the params file, then model_dir only when given
    func = next(n for n in TREE.body if isinstance(n, ast.FunctionDef) and n.name == "node_and_transitions")
    assert "if model_dir:" in ast.unparse(func)


def test_installed_executable_is_where_launch_ros_looks():
    """launch_ros runs <prefix>/lib/<package>/<executable>: setup.cfg points colcon's install there."""
    assert (ROOT / "setup.cfg").read_text().count("$base/lib/litevlm") == 2
    assert "litevlm_drive_node = litevlm_runtime.ros.runner:main" in (ROOT / "setup.py").read_text()
