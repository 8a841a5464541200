"""What the user writes, read and checked: the experiment file (`schema`, with its `link`
section in `link_section`, its `devices` section in `devices_section` (the fleet a trial
resolves to: `resolved_fleet`), its `timeline` in `timeline_section` and its method grid in
`method_grid`), link profiles (`profiles`), device profiles (`device_profiles`), the accuracy
study's table of top-1 per level that an experiment may name (`level_accuracy`), and what they
share: strict pydantic models with one-line errors (`strict`), the YAML reader (`yamlfile`) and
the names that become path components (`names`).

Nothing here knows where a run happens: what depends on the host, the backend or the
emulator is checked by `testbed.sweep.preflight`. The schema knows no backend either: a
backend's own section is a `sections.Section`, defined in the backend's folder (the ssh
backend's `inventory:`, the enoslib backend's `provider:`) and registered when its module is
imported; the backend table (`testbed.backends.table`) imports every backend.
"""
