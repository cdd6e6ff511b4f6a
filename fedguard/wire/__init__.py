"""The messages between clients and server: the reply's typed records, the declared record, the sparse encoding."""
