"""Template text generator for the synthetic training corpus.

Sentences come out in *spoken* form (numbers, dates and times already written as words), because the
training transcript must say exactly what the teacher voice says, and the inference frontend normalises
digits to words before the LLM sees them. Each language has a small grammar: plain statements, questions,
numbers, dates/times, and long sentences made of two or three clauses. `sentences(lang, n, seed)` is
deterministic for (lang, n, seed).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from vocalis.eval.text_norm import integer_words, ordinal_words, year_words

LANGUAGES = ("en", "zh", "de", "fr", "es")

# ---- English -------------------------------------------------------------------------------------------
_EN = {
    "subj": ["the teacher", "my brother", "our neighbour", "a young doctor", "the old man", "her daughter",
             "the pilot", "a tired student", "the farmer", "my best friend", "the manager", "a small child",
             "the engineer", "his mother", "the musician", "everyone in the room", "the driver", "a stranger"],
    "verb_past": ["found", "painted", "carried", "opened", "cleaned", "sold", "bought", "fixed", "described",
                  "borrowed", "forgot", "watched", "noticed", "wrote", "checked", "moved", "closed", "ordered"],
    "verb": ["find", "paint", "carry", "open", "clean", "sell", "buy", "fix", "describe", "borrow", "watch",
             "write", "check", "move", "close", "order", "bring", "remember"],
    "obj": ["a red bicycle", "the wooden door", "an old letter", "the heavy box", "a map of the city",
            "the kitchen window", "a cup of coffee", "the broken clock", "a new computer", "the blue notebook",
            "a bag of apples", "the garden gate", "a long report", "the train tickets", "a warm blanket"],
    "place": ["in the park", "at the station", "near the river", "behind the library", "in the kitchen",
              "at the market", "on the bridge", "in the small village", "by the harbour", "at the office"],
    "time": ["this morning", "last night", "yesterday afternoon", "before dinner", "after the storm",
             "on Monday", "early in the evening", "during the summer", "every weekend", "a week ago"],
    "adj": ["quiet", "bright", "cold", "strange", "beautiful", "crowded", "simple", "difficult", "wonderful",
            "dangerous", "calm", "noisy"],
    "noun": ["weather", "music", "story", "question", "answer", "idea", "garden", "meeting", "journey",
             "picture", "lesson", "city"],
    "noun_pl": ["apples", "books", "chairs", "people", "birds", "cars", "windows", "students", "boxes", "trees"],
    "conj": ["and", "but", "because", "so", "while", "although"],
    "month": ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
}


def _en_clause(r: random.Random) -> str:
    c = r.choice
    forms = [
        lambda: f"{c(_EN['subj'])} {c(_EN['verb_past'])} {c(_EN['obj'])} {c(_EN['place'])}",
        lambda: f"{c(_EN['subj'])} {c(_EN['verb_past'])} {c(_EN['obj'])} {c(_EN['time'])}",
        lambda: f"the {c(_EN['noun'])} was {c(_EN['adj'])} {c(_EN['time'])}",
        lambda: f"{c(_EN['subj'])} wanted to {c(_EN['verb'])} {c(_EN['obj'])}",
        lambda: f"it was a {c(_EN['adj'])} {c(_EN['noun'])}",
    ]
    return c(forms)()


def _en_number(r: random.Random) -> str:
    c = r.choice
    n = r.choice([r.randint(2, 20), r.randint(21, 99), r.randint(100, 999), r.randint(1000, 99999)])
    forms = [
        lambda: f"There are {integer_words(n)} {c(_EN['noun_pl'])} {c(_EN['place'])}.",
        lambda: f"The ticket costs {integer_words(r.randint(2, 500))} dollars and {integer_words(r.randint(1, 99))} cents.",
        lambda: f"Please call me at {' '.join(integer_words(int(d)) for d in str(r.randint(1000000, 9999999)))}.",
        lambda: f"The train leaves from platform {integer_words(r.randint(1, 12))} at {_en_time(r)}.",
        lambda: f"She counted {integer_words(n)} {c(_EN['noun_pl'])} in total.",
        lambda: f"Room {integer_words(r.randint(100, 999))} is on the {ordinal_words(r.randint(1, 30))} floor.",
        lambda: f"About {integer_words(r.randint(2, 99))} percent of the {c(_EN['noun_pl'])} were sold.",
    ]
    return c(forms)()


def _en_time(r: random.Random) -> str:
    h, m = r.randint(1, 12), r.choice([0, 5, 10, 15, 20, 30, 45, r.randint(1, 59)])
    if m == 0:
        return f"{integer_words(h)} o'clock"
    return f"{integer_words(h)} {'oh ' + integer_words(m) if m < 10 else integer_words(m)}"


def _en_date(r: random.Random) -> str:
    c = r.choice
    year = r.choice([r.randint(1900, 1999), r.randint(2010, 2030)])
    forms = [
        lambda: f"The meeting is on {c(_EN['month'])} {ordinal_words(r.randint(1, 28))}.",
        lambda: f"She was born on {c(_EN['month'])} {ordinal_words(r.randint(1, 28))}, {year_words(year)}.",
        lambda: f"The shop opens at {_en_time(r)} on {c(_EN['day'])}.",
        lambda: f"We moved to the city in {year_words(year)}.",
        lambda: f"See you next {c(_EN['day'])} at {_en_time(r)}.",
    ]
    return c(forms)()


def _en_question(r: random.Random) -> str:
    c = r.choice
    forms = [
        lambda: f"Did {c(_EN['subj'])} {c(_EN['verb'])} {c(_EN['obj'])}?",
        lambda: f"Where did you put {c(_EN['obj'])}?",
        lambda: f"Why was the {c(_EN['noun'])} so {c(_EN['adj'])}?",
        lambda: f"How many {c(_EN['noun_pl'])} are there {c(_EN['place'])}?",
        lambda: f"Could you {c(_EN['verb'])} {c(_EN['obj'])} {c(_EN['time'])}?",
        lambda: f"What time does the {c(_EN['noun'])} start?",
        lambda: f"Is it true that {c(_EN['subj'])} {c(_EN['verb_past'])} {c(_EN['obj'])}?",
    ]
    return c(forms)()


def _en_short(r: random.Random) -> str:
    return r.choice(["Yes, of course.", "Thank you very much.", "Good morning.", "I am not sure.", "Please wait here.",
                     "That sounds great.", "See you soon.", "Let me think.", "Not today.", "Hello, how are you?",
                     "Goodbye for now.", "Excuse me.", "Welcome home.", "Well done.", "It is late."])


def _en_statement(r: random.Random) -> str:
    return _cap(_en_clause(r)) + "."


def _en_long(r: random.Random) -> str:
    parts = [_en_clause(r) for _ in range(r.randint(2, 3))]
    text = parts[0]
    for p in parts[1:]:
        text += f", {r.choice(_EN['conj'])} {p}"
    return _cap(text) + "."


# ---- Mandarin (Hanzi; the synthesiser converts to pinyin) -----------------------------------------------
_ZH_DIGITS = "零一二三四五六七八九"
_ZH = {
    "subj": ["我", "你", "他", "她", "我们", "老师", "妈妈", "我的朋友", "这个学生", "那位医生", "小明", "大家"],
    "verb_obj": ["喝茶", "看书", "写信", "买水果", "学习中文", "打电话", "吃晚饭", "听音乐", "开车", "做饭", "洗衣服",
                 "看电影", "画画", "唱歌"],
    "place": ["在家里", "在学校", "在公园", "在商店", "在火车站", "在北京", "在办公室", "在图书馆", "在饭馆"],
    "time": ["今天", "明天", "昨天晚上", "早上", "下午", "周末", "每天", "上个星期"],
    "adj": ["很好", "很忙", "非常高兴", "有点累", "很漂亮", "太贵了", "很安静", "很热闹"],
    "noun": ["天气", "这本书", "那个地方", "这件衣服", "我们的城市", "这个问题", "今天的菜"],
    "measure": [("本", "书"), ("个", "苹果"), ("张", "桌子"), ("辆", "汽车"), ("只", "猫"), ("杯", "咖啡")],
}


def zh_number(n: int) -> str:
    """0 <= n < 100000000 in Chinese numerals: 2024 -> 二千零二十四, 15 -> 十五."""
    if n < 10:
        return _ZH_DIGITS[n]
    if n >= 10000:
        high, low = divmod(n, 10000)
        rest = "" if low == 0 else ("零" if low < 1000 else "") + zh_number(low)
        return zh_number(high) + "万" + rest
    out, zero = "", False
    for value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = (n // value) % 10
        if d == 0:
            zero = bool(out)
            continue
        if zero:
            out += "零"
            zero = False
        out += ("" if (d == 1 and unit == "十" and not out) else _ZH_DIGITS[d]) + unit
    return out


def _zh(r: random.Random) -> str:
    c = r.choice
    forms = [
        lambda: f"{c(_ZH['subj'])}{c(_ZH['time'])}{c(_ZH['place'])}{c(_ZH['verb_obj'])}。",
        lambda: f"{c(_ZH['noun'])}{c(_ZH['adj'])}。",
        lambda: f"{c(_ZH['subj'])}想{c(_ZH['verb_obj'])}吗？",
        lambda: f"{c(_ZH['subj'])}为什么{c(_ZH['place'])}{c(_ZH['verb_obj'])}？",
        lambda: "桌子上有{}{}{}。".format(zh_number(r.randint(2, 99)), *c(_ZH["measure"])),
        lambda: f"今天是{zh_number(r.randint(1, 12))}月{zh_number(r.randint(1, 28))}日，星期{c('一二三四五六')}。",
        lambda: f"这个东西一共{zh_number(r.randint(2, 9999))}块钱。",
        lambda: f"现在是{zh_number(r.randint(1, 12))}点{zh_number(r.randint(10, 59))}分。",
        lambda: f"{c(_ZH['subj'])}{c(_ZH['time'])}{c(_ZH['verb_obj'])}，因为{c(_ZH['noun'])}{c(_ZH['adj'])}。",
        lambda: c(["你好。", "谢谢你。", "再见。", "没问题。", "对不起。", "好的，我知道了。", "请等一下。"]),
    ]
    return c(forms)()


# ---- German, French, Spanish: small grammars with number words up to 99 ----------------------------------
_DE_NUM = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf", "zwölf",
           "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
_DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
_FR_NUM = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix", "onze", "douze",
           "treize", "quatorze", "quinze", "seize", "dix-sept", "dix-huit", "dix-neuf", "vingt"]
_ES_NUM = ["cero", "uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve", "diez", "once", "doce",
           "trece", "catorce", "quince", "dieciséis", "diecisiete", "dieciocho", "diecinueve", "veinte"]


def de_number(n: int) -> str:
    if n < 20:
        return _DE_NUM[n]
    tens, ones = divmod(n, 10)
    return _DE_TENS[tens] if ones == 0 else ("ein" if ones == 1 else _DE_NUM[ones]) + "und" + _DE_TENS[tens]


_LANG_GRAMMAR = {
    "de": {
        "subj": ["Der Lehrer", "Meine Schwester", "Unser Nachbar", "Das Kind", "Die Ärztin", "Mein Freund"],
        "pred": ["kauft ein neues Fahrrad", "liest ein altes Buch", "öffnet das Fenster", "trinkt einen Kaffee",
                 "wartet am Bahnhof", "arbeitet im Garten", "schreibt einen langen Brief"],
        "time": ["heute", "morgen früh", "am Wochenende", "jeden Tag", "gestern Abend"],
        "q": ["Wo ist der Bahnhof?", "Wie spät ist es?", "Kommst du heute mit?", "Was machst du morgen?"],
        "num": lambda r: f"Wir haben {de_number(r.randint(2, 99))} Äpfel gekauft.",
        "conj": "und",
    },
    "fr": {
        "subj": ["Le professeur", "Ma sœur", "Notre voisin", "L'enfant", "Le médecin", "Mon ami"],
        "pred": ["achète un nouveau vélo", "lit un vieux livre", "ouvre la fenêtre", "boit un café",
                 "attend à la gare", "travaille dans le jardin", "écrit une longue lettre"],
        "time": ["aujourd'hui", "demain matin", "ce week-end", "tous les jours", "hier soir"],
        "q": ["Où est la gare?", "Quelle heure est-il?", "Tu viens avec nous?", "Qu'est-ce que tu fais demain?"],
        "num": lambda r: f"Nous avons acheté {_FR_NUM[r.randint(2, 20)]} pommes.",
        "conj": "et",
    },
    "es": {
        "subj": ["El profesor", "Mi hermana", "Nuestro vecino", "El niño", "La doctora", "Mi amigo"],
        "pred": ["compra una bicicleta nueva", "lee un libro viejo", "abre la ventana", "toma un café",
                 "espera en la estación", "trabaja en el jardín", "escribe una carta larga"],
        "time": ["hoy", "mañana por la mañana", "el fin de semana", "todos los días", "anoche"],
        "q": ["¿Dónde está la estación?", "¿Qué hora es?", "¿Vienes con nosotros?", "¿Qué haces mañana?"],
        "num": lambda r: f"Compramos {_ES_NUM[r.randint(2, 20)]} manzanas.",
        "conj": "y",
    },
}


def _other(lang: str) -> Callable[[random.Random], str]:
    g = _LANG_GRAMMAR[lang]

    def make(r: random.Random) -> str:
        c = r.choice
        clause = lambda: f"{c(g['subj'])} {c(g['pred'])} {c(g['time'])}"
        kind = r.random()
        if kind < 0.45:
            return clause() + "."
        if kind < 0.65:
            return c(g["q"])
        if kind < 0.8:
            return g["num"](r)
        return f"{clause()}, {g['conj']} {c(g['subj']).lower()} {c(g['pred'])}."

    return make


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


_EN_KINDS: tuple[tuple[float, Callable[[random.Random], str]], ...] = (
    (0.30, _en_statement), (0.18, _en_question), (0.17, _en_number), (0.12, _en_date), (0.08, _en_short),
    (0.15, _en_long),
)


def _english(r: random.Random) -> str:
    x, acc = r.random(), 0.0
    for weight, make in _EN_KINDS:
        acc += weight
        if x < acc:
            return make(r)
    return _en_long(r)


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "en": _english, "zh": _zh, "de": _other("de"), "fr": _other("fr"), "es": _other("es"),
}


def sentence(lang: str, r: random.Random) -> str:
    if lang not in GENERATORS:
        raise ValueError(f"no text generator for language {lang!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[lang](r)


def sentences(lang: str, n: int, seed: int = 0, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """`n` distinct sentences of `lang` (not in `exclude`), deterministic for (lang, n, seed, exclude)."""
    r = random.Random(f"{lang}:{seed}")
    out: list[str] = []
    seen = set(exclude)
    tries = 0
    while len(out) < n:
        s = sentence(lang, r)
        tries += 1
        if s not in seen or tries > 50 * n:  # small grammars (de/fr/es) run out of new sentences: allow repeats
            seen.add(s)
            out.append(s)
    return out
