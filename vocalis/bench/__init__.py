"""`vocalis bench`: the engine against the reference path, measured in one run."""
