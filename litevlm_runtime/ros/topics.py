"""The node's topic names (REP-144) and the remappings that give the shipped names.

Inside the node every name is relative, so `__ns` and remapping place an instance:

    cam_front/image_raw/compressed ...   the six cameras (parameter camera_topics; the camera's own
                                         namespace, then image_transport's image_raw[/compressed])
    query, question                      in:  litevlm_msgs/Query, std_msgs/String
    answer, answer_json                  out: litevlm_msgs/Answer, std_msgs/String (JSON)
    answer_partial                       out: litevlm_msgs/AnswerPartial (serving.stream_partials)
    ~/explanation                        out: sensor_msgs/CompressedImage, explained answers' pictures
                                         (private: /litevlm_drive/explanation; parameter `explain`)
    ~/standing/NAME                      out: litevlm_msgs/Answer, the answers of standing question NAME
                                         (parameter standing_questions; serving/standing.py)
    /diagnostics                         absolute, by ROS convention

The shipped names (`/cam_front/image_raw/compressed`, `/litevlm/query`, ...) come from the root
namespace plus SHIPPED_REMAPS, applied by launch/drive.launch.py (`remappings=`) and by
`litevlm drive` (`-r`). The remap targets are relative too, so under `__ns:=/car1` the query
topic is `/car1/litevlm/query`. Remaps are not parameters, so config/drive.yaml cannot carry them.
"""

from __future__ import annotations

from ..cameras import CAMERAS

QUERY, QUESTION, ANSWER, ANSWER_JSON = "query", "question", "answer", "answer_json"
ANSWER_PARTIAL = "answer_partial"
EXPLANATION = "~/explanation"
STANDING = "~/standing"


def standing_topic(name: str) -> str:
    """The topic of standing question `name`'s answers (private: /litevlm_drive/standing/NAME)."""
    return f"{STANDING}/{name}"
DIAGNOSTICS = "/diagnostics"
DEFAULT_CAMERA_TOPICS = tuple(f"{c.lower()}/image_raw/compressed" for c in CAMERAS)

# (from, to), in the order rcl tries them (the first rule that matches wins: a user's own
# remap must come before these).
SHIPPED_REMAPS = (
    (QUERY, "litevlm/query"),
    (QUESTION, "litevlm/question"),
    (ANSWER, "litevlm/answer"),
    (ANSWER_JSON, "litevlm/answer_json"),
    (ANSWER_PARTIAL, "litevlm/answer_partial"),
)


def expand(name: str, namespace: str = "/", node_name: str = "litevlm_drive") -> str:
    """A topic name made absolute as rcl expands it: `~` is the node's own name, a relative
    name is under the namespace."""
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    if name.startswith("/"):
        return name
    if name == "~" or name.startswith("~/"):
        return f"{ns}/{node_name}{name[1:]}"
    return f"{ns}/{name}"


def resolve(name: str, namespace: str = "/", remaps=SHIPPED_REMAPS, node_name: str = "litevlm_drive") -> str:
    """What a node in `namespace` with `remaps` subscribes to for `name`; for the tools that have
    no node to ask (bag eval, bag replay). rclpy's Node.resolve_topic_name gives the same (tested);
    both sides of a rule are expanded in the node's namespace before they are compared."""
    full = expand(name, namespace, node_name)
    for src, dst in remaps:
        if expand(src, namespace, node_name) == full:
            return expand(dst, namespace, node_name)
    return full


def shipped_topic_names(camera_topics, namespace: str = "/") -> dict:
    """The node's topics where the shipped remappings apply: camera_topics resolved, plus
    query_topic, question_topic, answer_topic, answer_json_topic and answer_partial_topic (what
    the bag tools publish and read)."""
    return {
        "camera_topics": [resolve(t, namespace) for t in camera_topics],
        "query_topic": resolve(QUERY, namespace),
        "question_topic": resolve(QUESTION, namespace),
        "answer_topic": resolve(ANSWER, namespace),
        "answer_json_topic": resolve(ANSWER_JSON, namespace),
        "answer_partial_topic": resolve(ANSWER_PARTIAL, namespace),
    }
