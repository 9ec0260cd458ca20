"""inventory: prices, stock levels and labels of a small shop."""

from inventory.pricing import apply_discount, total
from inventory.stock import low_stock, restock
from inventory.text import slugify

__all__ = ["apply_discount", "low_stock", "restock", "slugify", "total"]
