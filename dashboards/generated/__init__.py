"""The generated Grafana dashboards (``kvguard dashboards generate`` writes the JSON beside this
file), shipped in the kvguard wheel as ``kvguard.dashboards`` so that ``kvguard dashboards
push`` works from an installed package with no checkout."""
