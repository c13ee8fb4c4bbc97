"""Helpers shared by tests of several modules, imported as ``tests.support.<module>``
(``soak/``: the engine soak's workload, watch and known false alarms)."""
