"""The fine-tuning study's task: a fixed-format record transformation with one right answer.

A request lists a person's fields in a random order and wording; the answer is the record in
one fixed format, `Surname, Given | born YEAR | City (COUNTRY CODE)`, e.g.

  user:      Write the record card. city: Lyon; given name: Marie; year of birth: 1987;
             family name: Dubois; country: France
  assistant: Dubois, Marie | born 1987 | Lyon (FR)

The skill needs every field found whatever its order and label, put in order, and the
country mapped to its code: SmolLM2-135M-Instruct does not produce the format zero-shot
(exact match near 0), and a few hundred fine-tuning steps teach it. Examples are drawn from
seeded lists (`make_examples`), the train and held-out splits from disjoint seeds and disjoint
surnames, so a held-out answer never appears in training. Scoring is exact match of the
reply's first line, spaces at its ends ignored.
"""

from __future__ import annotations

import json
import random
from typing import Iterable

GIVEN = ("Marie", "John", "Aiko", "Carlos", "Fatima", "Lars", "Priya", "Omar", "Elena", "Kofi",
         "Mei", "Diego", "Anna", "Tomas", "Leila", "Ivan", "Sofia", "Yusuf", "Hana", "Pierre",
         "Grace", "Mateo", "Nadia", "Felix", "Zara", "Hugo", "Ingrid", "Ravi", "Clara", "Kenji")
SURNAMES = ("Dubois", "Smith", "Tanaka", "Garcia", "Khan", "Berg", "Patel", "Haddad", "Rossi",
            "Mensah", "Wang", "Lopez", "Novak", "Silva", "Moreau", "Petrov", "Costa", "Yilmaz",
            "Sato", "Martin", "Walker", "Romero", "Ahmed", "Weber", "Ali", "Laurent", "Olsen",
            "Kumar", "Fischer", "Mori", "Brown", "Torres", "Nowak", "Santos", "Keller", "Ito",
            "Bianchi", "Hansen", "Reyes", "Schmidt", "Kowalski", "Nakamura", "Jensen", "Ortiz",
            "Meyer", "Dumont", "Abe", "Ferrari", "Lindqvist", "Moretti")
CITIES = (("Lyon", "France", "FR"), ("Osaka", "Japan", "JP"), ("Madrid", "Spain", "ES"),
          ("Lagos", "Nigeria", "NG"), ("Oslo", "Norway", "NO"), ("Pune", "India", "IN"),
          ("Cairo", "Egypt", "EG"), ("Milan", "Italy", "IT"), ("Accra", "Ghana", "GH"),
          ("Dalian", "China", "CN"), ("Lima", "Peru", "PE"), ("Brno", "Czechia", "CZ"),
          ("Porto", "Portugal", "PT"), ("Kazan", "Russia", "RU"), ("Izmir", "Turkey", "TR"),
          ("Leeds", "United Kingdom", "GB"), ("Austin", "United States", "US"),
          ("Munich", "Germany", "DE"), ("Gdansk", "Poland", "PL"), ("Quito", "Ecuador", "EC"))
LABELS = {"given": ("given name", "first name", "forename"),
          "surname": ("family name", "surname", "last name"),
          "year": ("year of birth", "born in", "birth year"),
          "city": ("city", "town", "lives in"),
          "country": ("country", "nation", "country of residence")}
INSTRUCTIONS = ("Write the record card.", "Format this person as a record card.",
                "Record card, please.", "Make the card for this person.")
# Surnames of the held-out split: never in the train split.
HELD_OUT_SURNAMES = SURNAMES[-10:]


def answer(given: str, surname: str, year: int, city: str, code: str) -> str:
  return f"{surname}, {given} | born {year} | {city} ({code})"


def make_examples(n: int, seed: int, split: str = "train") -> list[dict[str, str]]:
  """`n` examples {"prompt", "answer"} of `split` (train: the first 40 surnames; held_out:
  the last 10), deterministic in (seed, split)."""
  if split not in ("train", "held_out"):
    raise ValueError(f"split={split!r}; expected 'train' or 'held_out'")
  rng = random.Random(f"{split}:{seed}")
  surnames = HELD_OUT_SURNAMES if split == "held_out" else SURNAMES[:-10]
  out = []
  for _ in range(n):
    given, surname = rng.choice(GIVEN), rng.choice(surnames)
    city, country, code = rng.choice(CITIES)
    year = rng.randrange(1940, 2010)
    fields = [("given", given), ("surname", surname), ("year", str(year)), ("city", city),
              ("country", country)]
    rng.shuffle(fields)
    listed = "; ".join(f"{rng.choice(LABELS[k])}: {v}" for k, v in fields)
    out.append({"prompt": f"{rng.choice(INSTRUCTIONS)} {listed}",
                "answer": answer(given, surname, year, city, code)})
  return out


def messages(example: dict[str, str], with_answer: bool = True) -> list[dict[str, str]]:
  msgs = [{"role": "user", "content": example["prompt"]}]
  if with_answer:
    msgs.append({"role": "assistant", "content": example["answer"]})
  return msgs


def chat_text(examples: Iterable[dict[str, str]]) -> str:
  """The examples as a chat file's text (`--data=chat:FILE`: one {"messages": [...]} per
  line)."""
  return "".join(json.dumps({"messages": messages(ex)}) + "\n" for ex in examples)


def write_chat_file(path: str, examples: Iterable[dict[str, str]]) -> str:
  """The examples as a chat file (`chat_text`) at `path`."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(chat_text(examples))
  return path


def exact_match(reply: str, example: dict[str, str]) -> bool:
  lines = reply.strip().splitlines()
  return bool(lines) and lines[0].strip() == example["answer"]
