"""The verbs: each module does one command's work (eval, export, merge, generate); cli.py parses
and prints."""
