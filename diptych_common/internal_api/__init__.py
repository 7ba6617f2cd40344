"""The control plane's internal API as its callers see it: each endpoint's method and path once
(`endpoints`), each message once as a frozen dataclass with its wire form (`messages`), and the client
that the gateway, the workers and the command line call it with (`client`)."""
