"""The command line and the demo: the top layer, over the front and the integrations."""
