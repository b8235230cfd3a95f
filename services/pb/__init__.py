"""Generated protobuf and gRPC stubs for ``proto/lyanna/v1`` (regenerate with ``make proto``;
never edit by hand). The proto package is ``lyanna.v1``; the Python modules live here, flat,
so they never shadow the core ``lyanna`` package."""
