"""SynthDrive: procedurally rendered six-camera driving scenes with DriveLM-format QA.

world.py   scene sampling (road, ego state, objects) in the ego frame
camera.py  pinhole cameras of the nuScenes rig, projection and near-plane clipping
render.py  PIL rendering of one camera view + an object-ID mask
qa.py      DriveLM v1.1 questions and answers from a world and what each camera shows
motion.py  scenes in motion: every object's motion, its poses at K time steps, labels from the poses
generate.py  the `litevlm synth` driver: scenes -> JPEGs + train/val QA + ground truth
"""
