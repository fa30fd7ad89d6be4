"""One module per ``tformer`` subcommand."""
