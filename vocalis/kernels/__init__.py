"""The CPU platform: what this CPU can run (`cpu`, the one capability probe), which of our native kernels may run
(`config`), the kernels themselves (`build`, the C++ sources in `csrc/`, and their wrappers), and the process's
threads and memory (`threads`, `huge_pages`, `heap`). Imports nothing else of Vocalis."""
