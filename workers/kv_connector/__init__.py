"""KV that crosses workers: the connector interface between the engine and that KV (`base`), the prefill
and decode workers' connectors (`prefill`, `decode`), and the data path they move it over (`sender`,
`receiver`, `wire`, `paths`, `tcp`, `shm`, `staging`). Import from the modules themselves."""
