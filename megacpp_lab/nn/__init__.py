"""One file per layer; import from the layer's module (megacpp_lab.nn.engram, megacpp_lab.nn.m2rnn, ...)."""

__all__: list[str] = []
