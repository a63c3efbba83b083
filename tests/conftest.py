"""Test order: the files holding slow tests (multi-process equivalence runs, the examples, the architecture matrix)
run first, each file's tests in their own order. With two workers (README's `-n 2 --dist loadfile`), the long
files then start early and the short ones fill the gaps, instead of one long file running alone at the end."""


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files and tests keep their order otherwise
