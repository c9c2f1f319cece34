"""peft: see the architecture tree in README.md."""
