"""Stock levels: what runs low and how much to order."""


def low_stock(levels, threshold):
    """Names of the items whose quantity is below ``threshold``, sorted; ``levels`` maps name -> quantity.

    >>> low_stock({"nails": 3, "screws": 40, "bolts": 9}, 10)
    ['bolts', 'nails']
    """
    return sorted(name for name, quantity in levels.items() if quantity < threshold)


def restock(missing, batch):
    """How many units to order to cover ``missing`` units when the supplier sells whole batches of ``batch``.

    >>> restock(7, 5)
    10
    """
    if missing <= 0:
        return 0
    return -(-missing // batch) * batch
