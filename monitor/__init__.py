"""The monitor peer and its dashboard.

Placeholder: the monitor (reads signed progress records from the DHT, keeps SQLite history, serves the
dashboard) is not built yet; it arrives after the swarm layer.
"""
