"""Native peers (llama.cpp) run in child processes, so a crash, a signal or a hang there is an error, never a dead qtool."""
