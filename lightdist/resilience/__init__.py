"""Failures: a rank's heartbeat, restarts from the newest checkpoint, failure reports, and the random state a
resume restores.
"""
