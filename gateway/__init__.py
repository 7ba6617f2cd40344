"""The Diptych gateway: authenticates, validates, tokenizes, routes each request to a prefill and a
decode worker, streams tokens back and reports usage."""
