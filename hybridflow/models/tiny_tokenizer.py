"""The tokenizer of the built-in tiny models, built offline and deterministically.

A byte-level BPE (the GPT-2 / Qwen2 / SmolLM2 family) trained with the `tokenizers` library
on a small fixed corpus that lives in this file: arithmetic, common English words and the
words of a chat. Digits are split one per token before BPE (as SmolLM2 and Llama 3 do), so
"128" is always ["1", "2", "8"]: the RL tasks are arithmetic and the answer parser should
see digits, not merged chunks that differ between "12" and " 12".

Ids 0, 1, 2 are `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos: the end of a chat
turn), the same layout as SmolLM2. Pad is kept apart from eos so that a mask of `ids != pad`
never hides the token that ends a response. When the corpus cannot fill the requested vocab,
`<|reserved_N|>` special tokens fill it, so `len(tokenizer)` is always exactly `vocab_size`
and equals the model's embedding size.
"""

from __future__ import annotations

import itertools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens

# ChatML, as Qwen2 and SmolLM2 use it, without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several toward war lay against pattern slow center love
person money serve appear road map rain rule govern pull cold notice voice unit power town fine
certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green oh quick develop ocean warm
free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat
common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss
brought heat snow tire bring yes distant fill east paint language among
user assistant system Answer answer Question Solve solve Compute compute Calculate calculate Let
let step think thinking final result total sum difference product quotient remainder equals equal
plus minus times divided multiply add subtract divide number numbers value count twice half
please thanks thank hello hi sure okay correct wrong true false yes no because therefore so
""".split()

_SENTENCES = [
    "What is {a} + {b}?",
    "What is {a} - {b}?",
    "What is {a} * {b}?",
    "Compute {a} + {b} * {c}.",
    "Solve: {a} + {b} = ?",
    "Let's think step by step. {a} + {b} = {s}. The answer is {s}.",
    "The final answer is {s}.",
    "Answer: {s}",
    "#### {s}",
    "{a} + {b} = {s}",
    "({a} + {b}) * {c} = {p}",
    "Please put the final answer after ####.",
    "You are a helpful assistant.",
    "Hello! How can I help you today?",
    "Sure, here is the answer.",
    "The question asks for the sum of {a} and {b}, which is {s}.",
]


def tiny_corpus() -> list[str]:
    """The fixed training text: every word and template, repeated with numbers that vary."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 12)]
    lines += [w.capitalize() + "." for w in _WORDS]
    for i, template in enumerate(itertools.islice(itertools.cycle(_SENTENCES), 400)):
        a, b, c = (7 * i + 3) % 100, (13 * i + 5) % 50, i % 9 + 1
        lines.append(template.format(a=a, b=b, c=c, s=a + b, p=(a + b) * c))
    return lines


def build_tiny_tokenizer(vocab_size: int = 512, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the built-in corpus and wrap it for transformers.

    Deterministic: the same `vocab_size` gives the same vocab and merges in every process
    (tests/models/test_tiny.py compares a build in a fresh process, whose hash seeds differ).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tokenizer.get_vocab_size() == vocab_size
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    return wrapped
