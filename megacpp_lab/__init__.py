"""megacpp-lab: a workbench for the memory and attention subsystems of a hybrid C++ code LM."""

__version__ = "0.1.0"
