"""The monitor peer and its dashboard.

In progress: ``monitor.aggregate`` turns peers' signed progress records into the swarm's summary (tested
on hand-made records). Still to come: reading the records from the DHT, SQLite history, the HTTP API,
the dashboard and ``collab monitor`` / ``collab status``.
"""
