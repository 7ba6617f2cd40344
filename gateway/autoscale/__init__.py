"""How many workers each fleet should run: the scaling decision, its policy file, and the signals the gateway
exports."""
