"""Everyday English words for the corpus's sentences of plain English around a weather question. Each
is rare in the corpus, so the tokenizer splits most of them into short pieces, as it splits any word
a user writes that the corpus lacks; seeing hundreds of such words next to a name teaches the model to
copy the name and none of their pieces."""

NOUNS = (
    "bicycle", "kettle", "ladder", "blanket", "notebook", "violin", "wardrobe", "lantern", "carpet", "saucepan",
    "backpack", "helmet", "mirror", "pillow", "envelope", "hammer", "bucket", "curtain", "teapot", "basket",
    "scooter", "camera", "printer", "toaster", "suitcase", "bookshelf", "microwave", "sofa", "fridge", "radio",
    "piano", "guitar", "trumpet", "drum", "canoe", "tent", "sleeping bag", "fishing rod", "telescope", "compass",
    "wallet", "bracelet", "necklace", "scarf", "sweater", "boots", "sandals", "slippers", "mittens",
    "cabbage", "pumpkin", "carrot", "onion", "potato", "tomato", "lettuce", "cucumber", "pepper", "mushroom",
    "pancake", "omelette", "sandwich", "noodle soup", "lemonade", "biscuit", "muffin", "pie", "casserole", "salad",
    "puppy", "kitten", "parrot", "goldfish", "hamster", "rabbit", "tortoise", "pony", "goat", "donkey",
    "garden shed", "greenhouse", "balcony", "attic", "cellar", "driveway", "porch", "chimney", "gutter", "fence post",
    "sailboat", "caravan", "tractor", "lorry", "minibus", "ferry ticket", "passport", "invoice", "receipt", "parcel",
    "spreadsheet", "laptop", "keyboard", "charger", "headphones", "battery", "lamp", "candle", "vase", "clock",
    "puzzle", "chessboard", "kite", "skateboard", "frisbee", "sledge", "hammock", "deck chair", "umbrella stand",
    "paintbrush", "sewing machine", "toolbox", "wheelbarrow", "lawnmower", "hose", "watering can", "flowerpot",
    "birdhouse", "scarecrow", "beehive", "orchard", "vineyard", "meadow", "pond", "stream", "hedge", "cottage",
    "library book", "museum pass", "concert ticket", "birthday card", "wedding cake", "recipe", "map", "diary",
)
ADJECTIVES = (
    "old", "new", "red", "blue", "green", "yellow", "wooden", "metal", "heavy", "light", "tiny", "huge", "shiny",
    "dusty", "broken", "borrowed", "second-hand", "expensive", "cheap", "noisy", "quiet", "striped", "spotted",
    "folding", "electric", "antique", "handmade", "plastic", "leather", "woollen", "cotton", "glass", "silver",
    "golden", "purple", "orange", "brown", "grey", "pink", "crooked", "sturdy", "fragile", "favourite", "spare",
    "rusty", "polished", "tidy", "messy", "enormous", "little",
)
VERBS = (
    "bought", "painted", "lost", "borrowed", "cleaned", "repaired", "sold", "ordered", "moved", "carried",
    "measured", "wrapped", "polished", "returned", "collected", "photographed", "planted", "baked", "sketched",
    "washed", "folded", "weighed", "tested", "printed", "delivered", "assembled", "unpacked", "decorated",
    "rented", "fixed", "lent out", "gave away", "built", "sanded", "varnished", "emptied", "filled", "labelled",
    "hid", "dropped", "packed", "cooked", "sewed", "ironed", "swapped", "tuned", "inspected", "recycled",
)
