"""Labels: item names as shelf codes."""


def slugify(name):
    """A shelf code for an item name: lower case, words joined by single dashes.

    >>> slugify("  Steel  Wool Pads ")
    'steel-wool-pads'
    """
    return "-".join(name.lower().split())
