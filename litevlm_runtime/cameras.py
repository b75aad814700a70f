"""The six-camera nuScenes rig. Order matters: it is the index order of every per-camera tensor."""

CAMERAS = (
    "CAM_FRONT",
    "CAM_FRONT_LEFT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK",
    "CAM_BACK_LEFT",
    "CAM_BACK_RIGHT",
)
# Camera yaw in degrees (counter-clockwise from the ego heading), as on the nuScenes rig.
CAMERA_YAW_DEG = {
    "CAM_FRONT": 0.0,
    "CAM_FRONT_LEFT": 55.0,
    "CAM_FRONT_RIGHT": -55.0,
    "CAM_BACK": 180.0,
    "CAM_BACK_LEFT": 110.0,
    "CAM_BACK_RIGHT": -110.0,
}
