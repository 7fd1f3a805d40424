"""Terminal chat (`radixserve chat`): streams replies from a server or router, or from a model in this process."""
