"""The composition root: the command line, the config file, the settings, the
engines wired to the routes, and the server that runs it all.

The only code in ``proxy/`` that imports ``engines``; nothing on the request
path imports it (proxy/DESIGN.md, "Import directions").
"""
