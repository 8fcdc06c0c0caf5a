"""Backends named by a string: the registry of built-ins, dotted paths and entry points, the
hooks a plugin declares itself with (posttrain's and retrain's), and the option schemas they
describe."""
