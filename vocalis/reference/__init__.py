"""The reference path: one request at a time, the official modules' order of work. The oracle the tests and the
bench compare the engine against; nothing a user calls imports it."""
