"""Applications people run: the ``collab`` command and its subcommands (thin entry points).

Filled so far: ``validate`` and ``simulate``. The volunteer (``join``), organizer (``coordinator``) and
local swarm (``demo``) roles arrive with the swarm layer.
"""
