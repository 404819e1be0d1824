"""Multi-hop questions about invented entities, answerable only from a generated corpus.

MuSiQue and HotpotQA cannot be reached from here, and a real model may know the answers to
questions about real entities. So the experiment's *unknown* questions are about invented
people, organisations, cities and countries, which no pretrained model has seen:

* a person was born in a city and works for an organisation; an organisation was founded in a
  city by a person; a city lies in a country. Each fact is stated in one passage, and only there:
  the person's, the organisation's (which also lists its staff, so that a search for a person
  finds their employer's passage too), the city's.
* questions chain 2 or 3 of these facts, in natural phrasing ("In which country was the
  organisation that Vela Durn works for founded?"); `category` is the number of hops.
* every person also has a distractor passage that names other cities and organisations beside
  them (a trip, a meeting), so that a lexical match alone does not answer.

Questions about the people of `split="eval"` never share a person with `split="train"`'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sem_jax.data.example import Example

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr",
           "h", "j", "sh", "th", "gl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "nd", "rk"]
_CITY_ENDS = ["ford", "holm", "mouth", "wick", "stead", "vale", "bury", "gate"]
_COUNTRY_ENDS = ["ia", "land", "ova", "istan", "ania"]
_ORG_KINDS = ["Guild", "Company", "Society", "Institute", "Works", "Trust", "Foundation", "Bank"]
_JOBS = ["engineer", "painter", "physician", "teacher", "architect", "lawyer", "chemist", "journalist", "pilot",
         "librarian"]

QUESTIONS = {  # kind -> (hops, phrasing, the chain's last fact)
    "org_city": (2, "In which city was the organisation that {p} works for founded?"),
    "org_founder": (2, "Who founded the organisation that {p} works for?"),
    "birth_country": (2, "In which country was {p} born?"),
    "founder_birthplace": (3, "In which city was the founder of the organisation that {p} works for born?"),
    "org_country": (3, "In which country was the organisation that {p} works for founded?"),
}


@dataclasses.dataclass(frozen=True)
class Person:
    name: str
    job: str
    born: str       # city
    employer: str   # organisation
    since: int


@dataclasses.dataclass(frozen=True)
class Organisation:
    name: str
    city: str
    founder: str    # person
    year: int


@dataclasses.dataclass
class MultiHopWorld:
    countries: list[str]
    city_country: dict[str, str]
    orgs: dict[str, Organisation]
    people: dict[str, Person]
    train_people: list[str]
    eval_people: list[str]
    distractors: dict[str, str]   # person -> their distractor passage

    def answer(self, kind: str, person: str) -> str:
        p = self.people[person]
        org = self.orgs[p.employer]
        return {"org_city": org.city, "org_founder": org.founder, "birth_country": self.city_country[p.born],
                "founder_birthplace": self.people[org.founder].born,
                "org_country": self.city_country[org.city]}[kind]

    def questions(self, split: str) -> list[Example]:
        """Every question about the people of `split` ("train" or "eval"), one per kind."""
        people = self.train_people if split == "train" else self.eval_people
        out = []
        for person in people:
            for kind, (hops, phrasing) in QUESTIONS.items():
                out.append(Example(id=f"multihop-{split}-{kind}-{person.replace(' ', '_')}",
                                   question=phrasing.format(p=person), answers=(self.answer(kind, person),),
                                   source="multihop", needs_search=True, category=f"{hops}hop"))
        return out

    def passages(self) -> list[dict]:
        """The corpus: one passage per fact holder, and each person's distractor."""
        out = []
        for p in self.people.values():
            out.append({"id": f"person-{len(out)}", "title": p.name,
                        "text": f"{p.name} is a {p.job} who was born in {p.born}. Since {p.since}, {p.name} has "
                                f"worked for the {p.employer}."})
        staff: dict[str, list[str]] = {}
        for p in self.people.values():
            staff.setdefault(p.employer, []).append(p.name)
        for o in self.orgs.values():
            names = staff.get(o.name, [])
            listed = f" Its staff include {', '.join(names[:-1])} and {names[-1]}." if len(names) > 1 else \
                f" Its staff include {names[0]}." if names else ""
            out.append({"id": f"org-{len(out)}", "title": o.name,
                        "text": f"The {o.name} was founded in {o.year} in {o.city} by {o.founder}.{listed}"})
        for city, country in self.city_country.items():
            out.append({"id": f"city-{len(out)}", "title": city, "text": f"{city} is a city in {country}."})
        for person, text in self.distractors.items():
            out.append({"id": f"note-{len(out)}", "title": f"{person} (travels)", "text": text})
        return out


def _names(rng: np.random.RandomState, n: int, make, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        name = make()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def build_multihop_world(seed: int, *, people: int, eval_people: int, organisations: int, cities: int,
                         countries: int) -> MultiHopWorld:
    """A world with `people` people (the last `eval_people` of them asked about in evaluation
    only), drawn from `seed`; every organisation's founder is one of the people."""
    if not 0 < eval_people < people:
        raise ValueError(f"eval_people={eval_people} must be in (0, people={people})")
    if organisations > people:
        raise ValueError(f"organisations={organisations} > people={people}: every organisation needs a founder")
    rng = np.random.RandomState(seed)
    pick = lambda xs: xs[rng.randint(len(xs))]
    syllable = lambda: pick(_ONSETS) + pick(_VOWELS) + pick(_CODAS)
    word = lambda k: "".join(syllable() for _ in range(k)).capitalize()
    taken: set[str] = set()
    country_names = _names(rng, countries, lambda: word(2)[:-1] + pick(_COUNTRY_ENDS), taken)
    city_names = _names(rng, cities, lambda: word(1) + pick(_CITY_ENDS), taken)
    city_country = {c: pick(country_names) for c in city_names}
    person_names = _names(rng, people, lambda: f"{word(rng.randint(1, 3))} {word(rng.randint(1, 3))}", taken)
    org_names = _names(rng, organisations, lambda: f"{word(2)} {pick(_ORG_KINDS)}", taken)
    founders = list(rng.permutation(person_names)[:organisations])
    orgs = {o: Organisation(o, pick(city_names), str(f), int(rng.randint(1820, 1990)))
            for o, f in zip(org_names, founders)}
    folk = {p: Person(p, pick(_JOBS), pick(city_names), pick(org_names), int(rng.randint(1995, 2024)))
            for p in person_names}
    distractors = {}
    for p in person_names:  # other cities and organisations beside the person's name
        elsewhere, other = pick(city_names), pick(org_names)
        distractors[p] = (f"In {rng.randint(1995, 2024)}, {p} travelled to {elsewhere} to meet people from the "
                          f"{other}, and later visited {pick(city_names)}.")
    return MultiHopWorld(countries=country_names, city_country=city_country, orgs=orgs, people=folk,
                         train_people=person_names[:people - eval_people], eval_people=person_names[people - eval_people:],
                         distractors=distractors)
