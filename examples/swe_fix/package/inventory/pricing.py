"""Prices: order totals and discounts."""


def total(lines):
    """The total of an order: ``lines`` is a list of ``(price, quantity)`` pairs.

    >>> total([(2.5, 4), (1.0, 3)])
    13.0
    """
    return sum(price * quantity for price, quantity in lines)


def apply_discount(price, percent):
    """``price`` less ``percent`` per cent, rounded to cents.

    >>> apply_discount(80.0, 25)
    60.0
    """
    return round(price * (1 - percent / 100), 2)
