"""Command-line tools that ship with the package (`python -m dit_train.tools.<name>`)."""
