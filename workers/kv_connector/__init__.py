"""KV that crosses workers: the implementations of the engine's connector interface
(`workers.engine.connector`): the prefill and decode workers' connectors (`prefill`, `decode`), the KV
tier's (`tier`) and their composition (`multi`), and the data path they move KV over (`sender`,
`receiver`, `wire`, `paths`, `tcp`, `shm`, `staging`). Import from the modules themselves."""
