"""The peer daemon: lifecycle (start, join, loop calling the runtime round, shutdown), gate, status export, paths."""
