"""Discrete-event cluster simulator that drives the router's own placement policies."""
