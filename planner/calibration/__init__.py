"""Calibration: profiles the cost model reads (`profile`) and the measurements that write them
(`calibrate`)."""
