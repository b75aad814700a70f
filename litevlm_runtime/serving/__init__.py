"""Serving queries without ROS: the query server (queue, worker, frame matching, error answers),
the frame store and camera-message decoding. The ROS 2 node (ros/) is a thin adapter over it."""
