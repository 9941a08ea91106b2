"""The command line: main (the parser and the error policy), args (types, the field-to-flag table),
render (tables, JSON, progress bars), and one module per subcommand (config_from_args → library → render)."""
