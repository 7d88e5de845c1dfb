"""Native kernels and what decides them: the CPU capability probe (`cpu`), the extension build (`build`), the
C++ sources (`csrc/`), thread and huge-page helpers. Imports nothing else of Vocalis."""
