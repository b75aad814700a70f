"""Rosbag2 tooling, one concern a module: bag files (io), making bags from DriveLM-layout folders
(make), evaluating a bag through the node's serving code without DDS (evaluate), comparing two
runs (compare), and replaying / recording over DDS (dds, the only one that needs rclpy).

Bags are written and read with the pure-Python `rosbags` package (rosbag2_py is not available as
a wheel), MCAP by default. Any rosbag2 is read: a folder with metadata.yaml, a folder of
.mcap/.db3 files without one, or a bare .mcap/.db3 file. Its CDR bytes are what rclpy
(de)serializes, so the replayer reads messages with rosbags and hands them to rclpy unchanged
except for the re-stamping below; it publishes only the node's topics by default, each with the
QoS the bag recorded.

Time. A bag keeps the capture times of the frames (nuScenes: 2018). Replaying them as they are
would make every frame look years old to the node, so by default the replayer re-stamps: the
bag's first message maps to the moment the replay starts, and every header stamp (and a query's
deadline) is shifted with it, scaled by 1/rate, like a live rig. `bag eval` uses the bag's own
times as the clock instead; frame matching and answers agree, and frame stamps relative to the
query stamp (`frame_offsets_ms`) agree exactly at rate 1.

JSON lines (one answer per line) are the output of `bag record` and `bag eval`; see
server.AnswerRecord.to_json. `bag record` adds `received_ns` and `e2e_ms` (receipt minus the
query stamp, i.e. query publish -> answer received).
"""
