"""The allowed answers of a closed-form question, from the question's text alone (never from the
reference): `litevlm eval --constrain` passes them to the pipeline as Query choices do.

  options  "... Please select the correct answer from the following options: A. ... B. ..." ->
           the letters offered (answered by the letter, as DriveLM and SynthDrive references are)
  yes/no   a question opening with an auxiliary verb ("Is", "Are", "Does", "Would", ...) and
           offering no options -> "Yes." / "No." (the references' form)
Anything else is open: no choices.
"""

from __future__ import annotations

import re

OPTION_LETTER = re.compile(r"(?:^|\s)([A-D])\.\s")
AUXILIARIES = ("is", "are", "was", "were", "do", "does", "did", "will", "would", "can", "could", "should",
               "shall", "has", "have", "had", "may", "might", "must")


def closed_form_choices(question: str) -> list[str] | None:
    q = question.strip()
    offered = re.split(r"options", q, maxsplit=1, flags=re.IGNORECASE)
    if len(offered) == 2:
        letters = sorted(set(OPTION_LETTER.findall(offered[1] + " ")))
        if len(letters) >= 2:
            return letters
    first = re.split(r"\W+", q, maxsplit=1)[0].lower()
    if first in AUXILIARIES:
        return ["Yes.", "No."]
    return None
