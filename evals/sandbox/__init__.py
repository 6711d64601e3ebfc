"""The sandbox: model-written programs run under bubblewrap, a pass only on a positive signal."""
